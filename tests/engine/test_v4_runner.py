"""The rank's runner serving DeepSeek-V4 (engine/v4/runner.py) through an in-process
colocated rank (no Ray; chunked prefill, continuous batching): greedy tokens equal transformers'
``DeepseekV4ForCausalLM.generate`` (EOS off, as served), and every V4 block goes back
when the scheduler frees the request's block set."""

from __future__ import annotations

import time

import pytest
import torch

from engine.block_pool import BlockPool
from engine.request import RequestSpec
from engine.runner import ModelRunner, build_runner
from engine.sampling_params import SamplingParams
from engine.v4.runner import V4Runner

BLOCK, BLOCKS = 16, 24
# NOTE: prompt lengths around the window (8) and the ratios (4, 16); "b" arrives late
PROMPTS = {"a": 21, "b": 6, "c": 35}
NEW = {"a": 32, "b": 8, "c": 32}  # NOTE: transformers' reference costs ~0.3 s a token here


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 129000, (n,), generator=torch.Generator().manual_seed(seed))
                 .tolist())


@pytest.fixture(scope="module")
def hf_greedy(tiny_v4_ckpt):
    from transformers import DeepseekV4ForCausalLM  # noqa: PLC0415 (reference only)

    hf = DeepseekV4ForCausalLM.from_pretrained(tiny_v4_ckpt, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # NOTE: served with ignore_eos
    out = {}
    with torch.no_grad():
        for seed, (rid, n) in enumerate(PROMPTS.items()):
            ids = torch.tensor(_prompt(n, seed))[None]
            out[rid] = hf.generate(ids, max_new_tokens=NEW[rid], do_sample=False,
                                   pad_token_id=0)[0, n:].tolist()
    return out


def _rank(ckpt, num_kv_blocks: int = BLOCKS):
    """A colocated V4 rank in this process (no Ray): chunks of 8 (prompts split inside
    compression groups), 20 tokens per step (decode tokens share steps with chunks)."""
    from rank.colocated import ColocatedRole  # noqa: PLC0415
    from rank.config import InstanceConfig, SchedulerConfig  # noqa: PLC0415
    from rank.rank import Rank  # noqa: PLC0415

    scheduler = SchedulerConfig(block_size=BLOCK, num_kv_blocks=num_kv_blocks, chunk_size=8,
                                max_num_batched_tokens=20, max_num_seqs=4, prefix_cache=False)
    rank = Rank(InstanceConfig(name="colocated-0", role="colocated", checkpoint_dir=str(ckpt),
                               scheduler=scheduler), 0, ColocatedRole)
    rank.start_alone()
    return rank


def _collect(rank, out: dict[str, tuple], until: str | None = None,
             timeout_s: float = 120.0) -> dict[str, tuple]:
    """Poll events into ``out`` (request id -> (tokens, finish reason, error)) until every
    request finished, or (``until``) that one has a token."""
    deadline = time.monotonic() + timeout_s
    while (not out[until][0]) if until else any(v[1] is None for v in out.values()):
        assert time.monotonic() < deadline, f"not finished: {out}"
        for ev in rank.poll(0.2):
            toks, _, _ = out[ev.request_id]
            out[ev.request_id] = (toks + list(ev.token_ids), ev.finish_reason, ev.error)
    return out


def _generate(rid: str, n: int, seed: int, max_tokens: int):
    from rank.messages import Generate  # noqa: PLC0415

    return Generate(RequestSpec(rid, _prompt(n, seed),
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


def test_rank_serves_v4_batched_equal_to_hf(tiny_v4_ckpt, hf_greedy):
    """Through the colocated rank (rank.py builds the V4 runner, its pool frees V4 blocks):
    ``a`` and ``c`` at once, ``b`` once ``a``'s first token is out; then an abort; every V4
    block back at the end."""
    from rank.messages import Abort  # noqa: PLC0415

    rank = _rank(tiny_v4_ckpt)
    try:
        runner = rank.runner
        assert isinstance(runner, V4Runner)
        out = {rid: ([], None, None) for rid in PROMPTS}
        for seed, (rid, n) in enumerate(PROMPTS.items()):
            if rid == "b":
                _collect(rank, out, until="a")
            rank.request(_generate(rid, n, seed, NEW[rid]))
        assert _collect(rank, out) == {rid: (hf_greedy[rid], "length", None)
                                       for rid in PROMPTS}
        rank.request(_generate("x", 30, 9, max_tokens=60))
        assert rank.request(Abort("x"))
        assert _collect(rank, {"x": ([], None, None)})["x"][1] == "abort"
        _wait_v4_free(runner)  # NOTE: the idle loop applies x's release
        assert rank.leader.pool.num_live_sets == 0
    finally:
        rank.shutdown()


def test_rank_admits_by_v4_blocks_and_queues_the_rest(tiny_v4_ckpt, hf_greedy):
    """Pools of 3 blocks of 16: ``a`` (21 + 32 tokens) commits 2 window blocks (7 kept + a
    chunk of 8, not its 4 blocks of context), 1 per entries and state group, and one
    scheduler block (before: 4 of those, refused outright); ``c`` (35 + 32) waits queued
    while ``a`` runs (its window blocks would not fit) and runs after it: both equal
    transformers'; every block and commitment back. 21 + 200 tokens (55 CSA entries: 4 blocks)
    can never fit: an error naming the group at once."""
    rank = _rank(tiny_v4_ckpt, num_kv_blocks=3)
    try:
        runner, sched = rank.runner, rank.leader.scheduler
        rank.request(_generate("big", 21, 0, 200))
        _, reason, error = _collect(rank, {"big": ([], None, None)})["big"]
        assert reason == "error" and "entries/compressed_sparse_attention: 4, 3" in error
        out = {rid: ([], None, None) for rid in ("a", "c")}
        rank.request(_generate("a", PROMPTS["a"], 0, NEW["a"]))
        rank.request(_generate("c", PROMPTS["c"], 2, NEW["c"]))
        _collect(rank, out, until="a")
        with rank.leader.lock:
            assert [r.request_id for r in sched.waiting] == ["c"]
            assert runner.admission.committed()["window"] == 2
            assert len(sched.find("a").blocks) == 1
        assert _collect(rank, out) == {rid: (hf_greedy[rid], "length", None)
                                       for rid in ("a", "c")}
        _wait_v4_free(runner)
        assert rank.leader.pool.num_live_sets == 0
    finally:
        rank.shutdown()


def _wait_v4_free(runner, timeout_s: float = 5.0) -> None:
    """Every V4 group pool free and nothing committed within ``timeout_s``, no further
    request needed (the loop may be finishing the last step; once idle it applies the
    releases)."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = all(p.num_free_blocks == p.num_blocks for p in runner.pools.values())
        if free and not any(runner.admission.committed().values()) and not runner.caches:
            return
        assert time.monotonic() < deadline, (runner.admission.committed(), list(runner.caches))
        time.sleep(0.05)


def test_window_blocks_are_freed_during_decode(tiny_v4_ckpt):
    """20 prompt tokens + 16 decoded, blocks of 4 (window 8: 7 kept + 1 written): the window
    never holds more than 3 blocks, the 9 the context spans are never all taken."""
    from engine.runner import SeqStep  # noqa: PLC0415

    runner = build_runner(tiny_v4_ckpt, num_kv_blocks=BLOCKS, block_size=4)
    table = tuple(range(9))  # the scheduler's blocks: 36 tokens
    logits = runner.execute([SeqStep("r", _prompt(20, 0), 0, table)])
    for n in range(20, 36):
        logits = runner.execute([SeqStep("r", (int(logits[0].argmax()),), n, table)])
        assert runner.caches["r"].blocks.held()["window"] <= 3
    assert BLOCKS - runner.pools["window"].num_free_blocks <= 3


def test_request_shipped_between_runners_continues_as_colocated(tiny_v4_ckpt, hf_greedy):
    """What PD will do: one runner prefills ``c`` (35 tokens, chunks of 8) and samples its
    first token; another imports the exported tensors and decodes the other 31: transformers'
    32 tokens."""
    from engine.runner import SeqStep  # noqa: PLC0415

    prefill, decode = (build_runner(tiny_v4_ckpt, num_kv_blocks=BLOCKS, block_size=BLOCK)
                       for _ in range(2))
    prompt, table = _prompt(PROMPTS["c"], 2), tuple(range(5))
    for start in range(0, len(prompt), 8):
        logits = prefill.execute([SeqStep("c", prompt[start:start + 8], start, table)])
    out = [int(logits[0].argmax())]
    decode.import_request("c", table, prefill.export_request("c"), len(prompt))
    for n in range(len(prompt), len(prompt) + NEW["c"] - 1):
        out.append(int(decode.execute([SeqStep("c", (out[-1],), n, table)])[0].argmax()))
    assert out == hf_greedy["c"]


def test_unsupported_layouts_are_refused(tiny_v4_ckpt):
    from engine.runner import SeqStep  # noqa: PLC0415

    with pytest.raises(ValueError, match="layer_sharding.*MTP.*prefix cache"):
        build_runner(tiny_v4_ckpt, num_kv_blocks=4, block_size=BLOCK,
                     layer_sharding=("q_a_proj",), num_speculative_tokens=1,
                     prefix_cache=True)
    runner = build_runner(tiny_v4_ckpt, num_kv_blocks=4, block_size=BLOCK)
    assert runner._staging is None  # NOTE: PD's staging cache: only a PD role's use makes it
    assert [b.shape for b in runner.kv_cache.layer_buffers(0)] == [
        (4, BLOCK, w) for w in runner.kv_spec.layer_widths(0)]
    with pytest.raises(ValueError, match="transfer.layerwise false"):
        runner.execute([SeqStep("r", (1, 2), 0, (0,))], on_kv_written=lambda layer: None)


def test_an_unknown_expert_dtype_is_refused(tiny_v4_ckpt, tmp_path):
    """A config.json whose routed experts are stored in a format engine/v4 does not read
    (``expert_dtype`` other than fp4 / fp8 / bf16) is refused at rank load naming it, not
    read as if its raw values were weights (the release's FP4 experts load:
    tests/engine/test_v4_fp4.py)."""
    import json  # noqa: PLC0415

    from engine.model_config import CheckpointError  # noqa: PLC0415

    for f in tiny_v4_ckpt.iterdir():
        (tmp_path / f.name).symlink_to(f)
    raw = json.loads((tiny_v4_ckpt / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(raw | {"expert_dtype": "int4",
                                                            "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}))
    with pytest.raises(CheckpointError, match="expert_dtype is 'int4'"):
        build_runner(tmp_path, num_kv_blocks=4, block_size=BLOCK)


def test_v3_checkpoint_still_gets_model_runner(tiny_ckpt):
    assert isinstance(build_runner(tiny_ckpt, num_kv_blocks=2, block_size=BLOCK), ModelRunner)


def test_status_reports_each_v4_group_pool_while_a_request_holds_blocks(tiny_v4_ckpt):
    """``status().kv_groups``: every group's pool (window, entries/<kind>, state/<kind>) with
    its free / total blocks; while a 21-token request decodes, its window, entries and state
    blocks are taken in each group; once it ended (aborted) and its release applied, every
    group reads free == total again. The same numbers reach /metrics
    (``orch_kv_group_blocks``), the GetStatus proto and `orch status`."""
    from prometheus_client import generate_latest  # noqa: PLC0415

    from orchestrator.api.convert import status_from_proto, status_to_proto  # noqa: PLC0415
    from orchestrator.cli import format_status  # noqa: PLC0415
    from orchestrator.metrics import RouterMetrics  # noqa: PLC0415
    from orchestrator.status import InstanceView  # noqa: PLC0415
    from rank.messages import Abort  # noqa: PLC0415

    rank = _rank(tiny_v4_ckpt)
    try:
        runner = rank.runner
        totals = {name: pool.num_blocks for name, pool in runner.pools.items()}
        assert {g for g in totals if g != "window"} and all(
            g.startswith(("entries/", "state/")) for g in totals if g != "window")
        idle = rank.status().kv_groups
        assert [(g, total) for g, _, total in idle] == list(totals.items())
        assert all(free == total for _, free, total in idle)
        # NOTE: 21 tokens: past the window (8) and both ratios' first group (4, 16)
        rank.request(_generate("r", PROMPTS["a"], 0, max_tokens=60))
        _collect(rank, {"r": ([], None, None)}, until="r")
        busy = rank.status()
        held = {g: total - free for g, free, total in busy.kv_groups}
        assert all(held[g] >= 1 for g in totals), held  # NOTE: r still decodes 59 tokens

        metrics = RouterMetrics()
        metrics.update_instances([busy])
        for g, free, total in busy.kv_groups:
            for state, n in (("free", free), ("total", total)):
                assert metrics.registry.get_sample_value(
                    "orch_kv_group_blocks",
                    {"instance": "colocated-0", "group": g, "state": state}) == n
        assert "orch_kv_group_blocks" in generate_latest(metrics.registry).decode()
        view = InstanceView("colocated-0", "colocated", 1, "healthy", "", busy)
        (back,) = status_from_proto(status_to_proto([view], 1, "tiny-v4"))
        assert back.status.kv_groups == busy.kv_groups
        window_free = dict((g, f) for g, f, _ in busy.kv_groups)["window"]
        assert f"window {window_free}/{totals['window']}" in format_status([back])

        assert rank.request(Abort("r"))
        assert _collect(rank, {"r": ([], None, None)})["r"][1] == "abort"
        _wait_v4_free(runner)
        assert rank.status().kv_groups == tuple((g, n, n) for g, n in totals.items())
    finally:
        rank.shutdown()


def test_an_idle_rank_reports_every_v4_group_free_without_another_request(tiny_v4_ckpt):
    """Newcomer bug: an ended request's V4 blocks were freed only by the leader's next step,
    which an idle instance never takes: after any load `orch status` and
    ``orch_kv_group_blocks`` showed blocks held forever. Two requests finish (one by length,
    one aborted mid-decode); with nothing more sent, ``status().kv_groups`` reads free ==
    total within a few seconds and the runner holds no request cache."""
    from rank.messages import Abort  # noqa: PLC0415

    rank = _rank(tiny_v4_ckpt)
    try:
        runner = rank.runner
        totals = tuple((name, p.num_blocks, p.num_blocks) for name, p in runner.pools.items())
        out = {"a": ([], None, None), "c": ([], None, None)}
        rank.request(_generate("a", PROMPTS["a"], 0, max_tokens=4))
        rank.request(_generate("c", PROMPTS["c"], 2, max_tokens=60))
        _collect(rank, out, until="c")
        assert rank.request(Abort("c"))
        assert [v[1] for v in _collect(rank, out).values()] == ["length", "abort"]
        deadline = time.monotonic() + 3.0  # NOTE: the idle loop runs every 5 ms
        while (groups := rank.status().kv_groups) != totals:
            assert time.monotonic() < deadline, f"V4 blocks held while idle: {groups}"
            time.sleep(0.02)
        assert runner.num_live_requests() == 0
        assert not any(runner.admission.committed().values())
        assert rank.leader.pool.num_live_sets == 0
    finally:
        rank.shutdown()
