"""The family-neutral layer specs (engine/kv_layer_spec.py): MLA layers (V3, V3.2, GLM-5.2's
shared indexer layers, MTP) and DeepSeek-V4's kinds answer "what does a request of n tokens hold
in layers L" and "what does a decode step read of it" through one function each, byte for byte
what the per-family arithmetic they replace gave on every shipped config (the old formulas are
restated here as the reference)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.block_pool import BlockPool
from engine.kv_cache import KVCacheSpec
from engine.kv_groups import KV, WINDOW, kv_groups, reservation
from engine.kv_layer_spec import (MLA, MLA_INDEXER, PER_TOKEN, CachedTensor, LayerKVSpec,
                                  MLALayerSpec, held_bytes, held_elements, mla_layer_specs,
                                  read_bytes)
from engine.model_config import ModelConfig
from engine.pool_plan import RequestShape, plan_pools
from engine.v4.config import CSA, HCA, V4Config
from engine.v4.kv_spec import V4LayerSpec, layer_specs
from kv_transfer.layout import BufferSpec, KVLayout
from orchestrator.config.load import load_config
from orchestrator.config.memory_check import build_memory_plan
from orchestrator.config.memory_plan_v4 import kv_bytes_per_request as v4_request_bytes
from orchestrator.config.memory_plan_v4 import kv_elements_per_request
from orchestrator.planner import counts, counts_v4
from tests.e2e.harness import REPO

CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
V4_CONFIGS = [c for c in CONFIGS if c.startswith(("v4_", "a3_v4_"))]
MLA_CONFIGS = [c for c in CONFIGS if c not in V4_CONFIGS]
TOKENS = (0, 1, 7, 128, 4097, 65536)
# NOTE: the planner's decode contexts are prompt + output / 2 (whole or half tokens)
CONTEXTS = (1, 7, 127.5, 128, 2048, 2049.5, 4096, 9000.5, 65536 + 1536.0, 131072)
MODELS = sorted(p.parent for p in (REPO / "configs" / "models").glob("*/config.json"))


def _plan(config: str):
    cfg = load_config(REPO / "configs" / config, planning=config == "a3_v4_p2x16_d8x4.yaml")
    plan, source = build_memory_plan(cfg)
    assert plan is not None, source
    return plan


def _runner_spec(m: ModelConfig, mtp: int, dtype: torch.dtype) -> KVCacheSpec:
    """The spec engine/runner.py builds for ``m`` with ``mtp`` MTP caches (4 blocks of 16):
    the layer specs, sized by the pool plan."""
    layers = mla_layer_specs(m, mtp)
    plan = plan_pools(layers, 4, 16, None)
    return KVCacheSpec.from_layer_specs(layers, num_blocks=plan.blocks[KV],
                                        block_size=plan.block_sizes[KV], dtype=dtype,
                                        mtp_layers=mtp)


def _old_runner_spec(m: ModelConfig, mtp: int, dtype: torch.dtype) -> KVCacheSpec:
    """The spec engine/runner.py built from the model's fields before the layer specs."""
    flags = tuple(m.has_indexer(i) for i in range(m.num_hidden_layers + mtp))
    return KVCacheSpec(num_layers=m.num_hidden_layers + mtp, num_blocks=4, block_size=16,
                       kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim,
                       dtype=dtype, index_head_dim=m.index_head_dim,
                       index_layers=flags if any(flags) and not all(flags) else (),
                       mtp_layers=mtp, index_topk=m.index_topk)


def _old_buffers(spec: KVCacheSpec) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """KVCacheSpec.buffer_names / buffer_widths before the layer specs."""
    if spec.index_head_dim:
        return ("k", "v", "index_k"), (spec.kv_lora_rank, spec.qk_rope_head_dim,
                                       spec.index_head_dim)
    return ("k", "v"), (spec.kv_lora_rank, spec.qk_rope_head_dim)


def _old_widths(spec: KVCacheSpec, layer: int) -> tuple[int, ...]:
    """KVCacheSpec.layer_buffer_widths before the layer specs: a prefix of buffer_widths."""
    return _old_buffers(spec)[1][:3 if spec.has_index_k(layer) else 2]


def _old_layout(spec: KVCacheSpec, model: str, tp: int) -> KVLayout:
    """KVLayout.from_spec before the layer specs."""
    index_layers = tuple(i for i in range(spec.num_layers) if spec.has_index_k(i)) \
        if spec.index_layers else None
    buffers = tuple(BufferSpec(name, (width,), index_layers if name == "index_k" else None)
                    for name, width in zip(*_old_buffers(spec)))
    return KVLayout(model=model, kind="mla", buffers=buffers, num_kv_heads=None,
                    dtype=str(spec.dtype).removeprefix("torch."), num_layers=spec.num_layers,
                    block_size=spec.block_size, tp=tp, rope_layout=spec.rope_layout,
                    mtp_layers=spec.mtp_layers)


def test_mla_layer_kinds_and_rows():
    v3 = MLALayerSpec(512, 64)
    dsa = MLALayerSpec(512, 64, 128)
    assert isinstance(v3, LayerKVSpec) and (v3.kind, dsa.kind) == (MLA, MLA_INDEXER)
    assert [t.name for t in dsa.tensors()] == ["k", "v", "index_k"]
    assert all(t.per == PER_TOKEN for t in dsa.tensors())
    assert dsa.rows(CachedTensor("k", 512, PER_TOKEN), 1000) == 1000
    assert (v3.elements(1000), dsa.elements(1000)) == (576_000, 704_000)
    # layers 0, 2 with an indexer, 1 without; only k counted; layers picked
    specs = (dsa, v3, dsa)
    assert held_elements(specs, 10) == 10 * (704 + 576 + 704)
    assert held_elements(specs, 10, layers=[1, 2]) == 10 * (576 + 704)
    assert held_elements(specs, 10, names=("index_k",)) == 10 * 2 * 128
    assert held_bytes(specs, 10, 2.0, layers=[0]) == 10 * 704 * 2.0


@pytest.mark.parametrize("config", MLA_CONFIGS)
def test_mla_consumers_equal_the_formulas_they_replace(config):
    plan = _plan(config)
    m, prec = plan.model, plan.precision
    assert isinstance(m, ModelConfig)
    layers, indexed = m.num_hidden_layers, sum(m.indexer_layers)
    per_token = (layers * (m.kv_lora_rank + m.qk_rope_head_dim)
                 + indexed * m.index_head_dim) * prec.kv
    assert counts.kv_bytes_per_token(m, prec) == per_token
    for n in TOKENS:
        assert counts.kv_bytes_per_request(m, prec, n) == n * per_token
    for role in plan.roles:
        lay, rows = role.layout, {r.kind: r for r in role.rows}
        tokens = lay.num_kv_blocks * lay.block_size
        assert rows["KV cache: c_kv latent"].elements == layers * tokens * m.kv_lora_rank
        assert rows["KV cache: c_kv latent"].split == \
            f"{lay.num_kv_blocks} blocks x {lay.block_size} x {m.kv_lora_rank}"
        assert rows["KV cache: k_pe"].elements == layers * tokens * m.qk_rope_head_dim
        if m.uses_sparse_attention:
            assert rows["KV cache: index_k"].elements == indexed * tokens * m.index_head_dim
            assert rows["KV cache: index_k"].split.endswith(f", {indexed} layers")
        if lay.mtp:
            index_k = m.index_head_dim if m.uses_sparse_attention else 0
            assert rows["KV cache: MTP layer"].elements == tokens * (
                m.kv_lora_rank + m.qk_rope_head_dim + index_k)
    for mtp in (0, 1):
        for dtype in (torch.bfloat16, torch.float32):
            spec = _runner_spec(m, mtp, dtype)
            assert spec == _old_runner_spec(m, mtp, dtype)
            assert spec.layer_specs() == mla_layer_specs(m, mtp)
            assert (spec.buffer_names, spec.buffer_widths) == _old_buffers(spec)
            layout, old_layout = (f(spec, "m", 4) for f in (KVLayout.from_spec, _old_layout))
            assert layout.to_dict() == old_layout.to_dict()
            assert layout.fingerprint() == old_layout.fingerprint()
            elem = spec.element_size
            for i in range(spec.num_layers):
                assert spec.layer_buffer_widths(i) == _old_widths(spec, i)
                assert spec.layer_buffer_names(i) == _old_buffers(spec)[0][:len(
                    _old_widths(spec, i))]
            old = sum(sum(_old_widths(spec, i)) for i in range(spec.num_layers)) * elem
            assert spec.bytes_per_token == old
            assert spec.bytes_per_token_of(range(1, spec.num_layers, 2)) == sum(
                sum(_old_widths(spec, i)) for i in range(1, spec.num_layers, 2)) * elem


def test_index_layers_only_when_some_layers_lack_index_k():
    for flags in ((True, True), (False, False)):
        with pytest.raises(ValueError, match="leave it empty"):
            KVCacheSpec(num_layers=2, num_blocks=1, block_size=1, kv_lora_rank=8,
                        qk_rope_head_dim=4, index_head_dim=16, index_layers=flags)


def test_glm5_shared_layers_have_no_index_k():
    plan = _plan("glm5_1p1d.yaml")
    flags = plan.model.indexer_layers
    assert not all(flags) and any(flags)  # NOTE: the shipped GLM-5.2 config has shared layers
    specs = mla_layer_specs(plan.model, mtp_layers=1)
    assert [s.kind == MLA_INDEXER for s in specs] == list(flags) + [True]


@pytest.mark.parametrize("config", V4_CONFIGS)
def test_v4_request_bytes_equal_the_spec_sum(config):
    plan = _plan(config)
    m = plan.model
    assert isinstance(m, V4Config)
    specs = layer_specs(m)
    assert all(isinstance(s, V4LayerSpec) and isinstance(s, LayerKVSpec) for s in specs)
    for n in TOKENS:
        old = sum(kv_elements_per_request(m, n).values()) * plan.precision.kv
        assert v4_request_bytes(m, n, plan.precision.kv) == old
        assert held_elements(specs, n) == sum(s.elements(n) for s in specs)


def _old_mla_read(m: ModelConfig, kv: float, context: float) -> float:
    """counts.kv_read_per_seq before the layer specs."""
    latent = m.kv_lora_rank + m.qk_rope_head_dim
    if not m.uses_sparse_attention:
        return m.num_hidden_layers * kv * context * latent
    return kv * (m.num_hidden_layers * min(context, m.index_topk) * latent
                 + sum(m.indexer_layers) * context * m.index_head_dim)


def _old_v4_read(m: V4Config, kv: float, context: float) -> float:
    """counts_v4.kv_read_per_seq before the layer specs."""
    rates = dict(m.compress_rates)
    kinds = {k: m.layer_types.count(k) for k in (CSA, HCA)}
    window = min(context, m.sliding_window) * m.head_dim
    csa = min(context / rates[CSA], m.index_topk) * m.head_dim \
        + context / rates[CSA] * m.index_head_dim
    hca = context / rates[HCA] * m.head_dim
    return kv * (m.num_hidden_layers * window + kinds[CSA] * csa + kinds[HCA] * hca)


def _shipped_models():
    """(name, model config, bytes per KV element) of every configs/*.yaml and, at 1 and 2
    bytes, every configs/models/*/config.json."""
    out = []
    for config in CONFIGS:
        plan = _plan(config)
        out.append((config, plan.model, plan.precision.kv))
    for path in MODELS:
        raw = json.loads((path / "config.json").read_text())
        model = V4Config.from_dict(raw) if raw.get("model_type") == "deepseek_v4" \
            else ModelConfig.from_dict(raw)
        out += [(f"{path.name} x{kv}", model, kv) for kv in (1.0, 2.0)]
    return out


def test_decode_read_bytes_equal_the_formulas_they_replace():
    seen = set()
    for name, m, kv in _shipped_models():
        v4 = isinstance(m, V4Config)
        specs = layer_specs(m) if v4 else mla_layer_specs(m)
        c, old = (counts_v4, _old_v4_read) if v4 else (counts, _old_mla_read)
        prec = _plan(V4_CONFIGS[0] if v4 else MLA_CONFIGS[0]).precision
        for context in CONTEXTS:
            want = old(m, kv, context)
            assert read_bytes(specs, context, kv) == want, (name, context)
            if kv == prec.kv:
                assert c.kv_read_per_seq(m, prec, context) == want, (name, context)
        seen.add((type(m).__name__, m.uses_sparse_attention if not v4 else True,
                  not v4 and not all(m.indexer_layers)))
    # NOTE: dense MLA, DSA, DSA with shared layers (GLM-5.2) and V4 all covered
    assert {("ModelConfig", False, True), ("ModelConfig", True, False),
            ("ModelConfig", True, True), ("V4Config", True, False)} <= seen


def test_read_rows_by_kind():
    dense, dsa, shared = MLALayerSpec(512, 64), MLALayerSpec(512, 64, 128, 2048), \
        MLALayerSpec(512, 64, 0, 2048)
    assert read_bytes((dense,), 4096, 2.0) == 2.0 * 4096 * 576
    assert read_bytes((dsa,), 4096, 2.0) == 2.0 * (2048 * 576 + 4096 * 128)
    assert read_bytes((shared,), 4096, 1.0) == 2048 * 576
    assert read_bytes((dsa,), 100, 1.0) == 100 * 704  # below top-k: every token
    csa = V4LayerSpec("compressed_sparse_attention", head_dim=512, sliding_window=128,
                      compress_ratio=4, overlap=True, index_head_dim=128, index_topk=512)
    hca = V4LayerSpec("heavily_compressed_attention", head_dim=512, sliding_window=128,
                      compress_ratio=128, overlap=False, index_head_dim=0)
    # window 128 rows, CSA 512 of 1024 entries + 1024 index keys, HCA all 32 entries; no state
    assert read_bytes((csa,), 4096, 1.0) == 128 * 512 + 512 * 512 + 1024 * 128
    assert read_bytes((hca,), 4096, 1.0) == 128 * 512 + 32 * 512
    assert read_bytes((csa, hca), 6, 1.0) == 6 * 512 + 1.5 * (512 + 128) + 6 * 512 + 6 / 128 * 512


@pytest.mark.parametrize("config", MLA_CONFIGS)
def test_mla_pools_are_sized_through_the_spec_groups_as_v4s_are(config):
    """MLA's pool comes out of the same plan_pools / kv_groups / reservation as V4's group
    pools: one group, kv (every layer's k, v, index_k, one row per token, all kept), of the
    role's num_kv_blocks blocks (the block counts and bytes of before), and a request reserves
    there what the scheduler's pool counts, ceil(tokens / block_size)."""
    plan = _plan(config)
    m = plan.model
    for role in plan.roles:
        lay = role.layout
        layers = mla_layer_specs(m, int(lay.mtp))
        pools = plan_pools(layers, lay.num_kv_blocks, lay.block_size, None)
        (group,) = kv_groups(layers)
        assert (group.name, group.keep_tokens, group.layers) == (KV, 0, tuple(range(len(layers))))
        assert pools.blocks == {KV: lay.num_kv_blocks}
        assert pools.block_sizes == {KV: lay.block_size}
        kv_rows = sum(r.elements for r in role.rows if r.group == "kv")
        assert pools.elements(KV) == kv_rows  # NOTE: what the memory plan prints
        spec = KVCacheSpec.from_layer_specs(layers, num_blocks=lay.num_kv_blocks,
                                            block_size=lay.block_size, mtp_layers=int(lay.mtp))
        assert group.row_elements * spec.element_size == spec.bytes_per_token
        pool = BlockPool(lay.num_kv_blocks, lay.block_size)
        for n in TOKENS:
            for step in (1, 7, 512):
                assert reservation((group,), pools.block_sizes, n, step)[KV] == \
                    pool.blocks_needed(n)


def test_v4_pools_read_the_same_groups():
    """V4's layer specs give the window group (kept tokens: sliding_window - 1) and per
    compressed kind entries + state, through the function MLA's kv group comes from."""
    m = V4Config.from_dict(json.loads((REPO / "configs/models/deepseek-v4/config.json")
                                      .read_text()))
    groups = kv_groups(layer_specs(m))
    assert groups[0].name == WINDOW and groups[0].keep_tokens == m.sliding_window - 1
    assert {g.name.split("/")[0] for g in groups[1:]} == {"entries", "state"}
    plan = plan_pools(layer_specs(m), 64, 16, RequestShape(4, 8192, 1))
    assert set(plan.blocks) == {g.name for g in groups} and KV not in plan.blocks


def test_a_cache_spec_is_made_of_one_mla_width():
    with pytest.raises(ValueError, match="MLA layers"):
        KVCacheSpec.from_layer_specs(layer_specs(V4Config.from_dict(json.loads(
            (REPO / "configs/models/deepseek-v4/config.json").read_text()))), num_blocks=1,
            block_size=1)
    with pytest.raises(ValueError, match="one k / v / index_k width"):
        KVCacheSpec.from_layer_specs((MLALayerSpec(512, 64), MLALayerSpec(256, 64)),
                                     num_blocks=1, block_size=1)
    with pytest.raises(ValueError, match="one token window"):
        kv_groups(())


def test_the_runner_builds_its_cache_and_pool_from_the_specs(tiny_glm_shared_ckpt):
    """A real MLA runner (GLM-5.2: shared layers without index_k): its cache spec is the
    layer specs' (equal to the field-built one of before) and its scheduler pool the plan's
    kv group, num_kv_blocks blocks (rank/leader.py sizes the pool by scheduler_blocks)."""
    from dataclasses import replace

    from engine.runner import build_runner

    runner = build_runner(tiny_glm_shared_ckpt, num_kv_blocks=8, block_size=4)
    m = runner.model_config
    assert runner.kv_spec == replace(_old_runner_spec(m, 0, torch.float32), num_blocks=8,
                                     block_size=4)
    assert runner.kv_spec.layer_specs() == mla_layer_specs(m)
    assert runner.scheduler_blocks == 8 == runner.kv_cache.k_caches[0].shape[0]
