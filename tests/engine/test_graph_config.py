"""Graph mode config: the decode.graph section reaches decode and colocated instances, the
prefill.graph section prefill and colocated ones (refused, with the fix, where it has no
capture), and bad buckets and backends name their key path."""

from __future__ import annotations

import pytest

from engine.graph import GraphConfig
from engine.prefill_graph import PrefillGraphConfig
from orchestrator.config.errors import ConfigError
from orchestrator.config.load import load_config


def _load(tmp_path, text: str):
    path = tmp_path / "orch.yaml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_decode_graph_reaches_decode_and_colocated_instances(tmp_path, mode):
    cfg = _load(tmp_path, f"mode: {mode}\n"
                          "decode: {graph: {enabled: true, batch_sizes: [1, 4], warmup: true}}\n")
    want = GraphConfig(enabled=True, batch_sizes=(1, 4), warmup=True)
    got = {inst.role: inst.graph for inst in cfg.instances()}
    assert got.pop("prefill", GraphConfig()) == GraphConfig()  # prefill: always off
    assert set(got.values()) == {want}


def test_graph_is_off_by_default(tmp_path):
    cfg = _load(tmp_path, "mode: colocated\n")
    assert {inst.graph for inst in cfg.instances()} == {GraphConfig()}
    assert not GraphConfig().enabled


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_prefill_graph_reaches_prefill_and_colocated_instances(tmp_path, mode):
    cfg = _load(tmp_path, f"mode: {mode}\nprefill: {{graph: {{enabled: true}}}}\n")
    got = {inst.role: inst.prefill_graph for inst in cfg.instances()}
    assert got.pop("decode", PrefillGraphConfig()) == PrefillGraphConfig()  # decode: off
    assert set(got.values()) == {PrefillGraphConfig(enabled=True, warmup=True)}
    assert not PrefillGraphConfig().enabled


@pytest.mark.parametrize("text, named", [
    ("prefill: {cp: 2, graph: {enabled: true}}\n", "prefill.cp > 1"),
    ("prefill: {ep: true, dp: 2, graph: {enabled: true}}\n", "prefill.ep"),
    ("mode: colocated\ndecode: {ep: true, dp: 2}\nprefill: {graph: {enabled: true}}\n",
     "decode.ep"),
    ("prefill: {graph: {enabled: true}}\ndecode: {speculative: {method: mtp}}\n",
     "decode.speculative"),
])
def test_prefill_graph_is_refused_without_a_capture_with_the_fix(tmp_path, text, named):
    with pytest.raises(ConfigError, match=rf"prefill\.graph does not run with {named}.*set "
                                          r"prefill\.graph\.enabled false"):
        _load(tmp_path, text)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
@pytest.mark.parametrize("arch, named", [
    ("deepseek_v32", r"prefill\.graph does not run DSA.*set prefill\.graph\.enabled false"),
    ("glm_moe_dsa", r"prefill\.graph does not run DSA.*set prefill\.graph\.enabled false"),
    ("deepseek_v4", r"DeepSeek-V4.*not supported yet: prefill\.graph\.enabled \(set false\)")])
def test_prefill_graph_with_a_model_it_cannot_run_is_refused_at_load(tmp_path, monkeypatch,
                                                                      arch, named, mode):
    """A DSA (V3.2, GLM-5) or V4 checkpoint with prefill.graph is refused when the config
    loads (so by ``--dry-run`` too), naming the key: not only by every rank at start-up."""
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))  # NOTE: the tiny config, not made yet
    text = (f"mode: {mode}\nmodel: {{path: tiny, tiny_arch: {arch}, max_model_len: 256}}\n"
            "prefill: {prefix_cache: false, graph: {enabled: true}}\n"
            "decode: {prefix_cache: false}\n")
    with pytest.raises(ConfigError, match=rf"(?s){named}"):
        _load(tmp_path, text)
    assert _load(tmp_path, text.replace("enabled: true", "enabled: false"))


def test_prefill_graph_unknown_backend_names_the_registered_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"prefill\.graph: backend 'cudagraph' is not one "
                                          r"of \['compile'\]"):
        _load(tmp_path, "prefill: {graph: {backend: cudagraph}}\n")


@pytest.mark.parametrize("sizes", ["[4, 2]", "[0, 1]", "[2, 2]", "[]"])
def test_bad_batch_sizes_name_their_key(tmp_path, sizes):
    with pytest.raises(ConfigError, match=r"decode\.graph"):
        _load(tmp_path, f"decode: {{graph: {{batch_sizes: {sizes}}}}}\n")


def test_unknown_backend_names_the_registered_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"decode\.graph: backend 'tensorrt' is not one of "
                                          r"\['compile', 'cudagraph', 'npugraph'\]"):
        _load(tmp_path, "decode: {graph: {backend: tensorrt}}\n")


def test_bucket_is_the_smallest_at_least_the_batch():
    cfg = GraphConfig(batch_sizes=(1, 2, 4, 8))
    assert [cfg.bucket(b) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


@pytest.mark.parametrize("sizes, max_num_seqs, want", [
    ("[1, 2, 4, 8, 16, 32]", 10, (1, 2, 4, 8, 10)),
    ("[1, 100000000]", 8, (1, 8)),  # a batch of 2 is never padded to 10^8 rows
    ("[2, 4]", 64, (2, 4)),
])
def test_buckets_above_max_num_seqs_become_max_num_seqs(tmp_path, sizes, max_num_seqs, want):
    cfg = _load(tmp_path, f"mode: colocated\ndecode: {{max_num_seqs: {max_num_seqs}, "
                          f"graph: {{enabled: true, batch_sizes: {sizes}}}}}\n")
    assert {inst.graph.batch_sizes for inst in cfg.instances()} == {want}


def test_a_backend_without_the_device_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"decode\.graph\.backend 'cudagraph' has no "
                                          r"implementation on cluster\.device 'cpu'.*"
                                          r"one of \['compile'\]"):
        _load(tmp_path, "cluster: {device: cpu}\n"
                        "decode: {graph: {enabled: true, backend: cudagraph}}\n")
    _load(tmp_path, "cluster: {device: cpu}\ndecode: {graph: {enabled: false, "
                    "backend: cudagraph}}\n")  # off: not checked


def test_required_reaches_the_runners(tmp_path):
    cfg = _load(tmp_path, "mode: colocated\n"
                          "decode: {graph: {enabled: true, batch_sizes: [1, 4], required: true}}\n")
    assert {inst.graph.required for inst in cfg.instances()} == {True}


def test_graph_with_ep_needs_a_bucket_for_every_batch(tmp_path):
    """Graph mode + EP: every step uses the fixed-capacity EP dispatch of the largest bucket."""
    with pytest.raises(ConfigError, match=r"largest bucket \(4\) must be >= "
                                          r"decode.max_num_seqs \(8\)"):
        _load(tmp_path, "decode: {dp: 2, ep: true, max_num_seqs: 8,\n"
                        "         graph: {enabled: true, batch_sizes: [1, 4]}}\n")
    cfg = _load(tmp_path, "decode: {dp: 2, ep: true, max_num_seqs: 8,\n"
                          "         graph: {enabled: true, batch_sizes: [1, 8]}}\n")
    assert cfg.decode.graph.batch_sizes == [1, 8]


def test_colocated_graph_with_ep_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="decode.graph with decode.ep in colocated mode.*"
                                          "run disaggregated"):
        _load(tmp_path, "mode: colocated\n"
                        "decode: {dp: 2, ep: true, max_num_seqs: 8,\n"
                        "         graph: {enabled: true, batch_sizes: [1, 8]}}\n")
