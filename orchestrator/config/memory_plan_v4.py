"""Per-rank memory plan of DeepSeek-V4: the :mod:`.memory_plan` table (same :class:`RolePlan`
rows, groups and report) for a :class:`engine.v4.config.V4Config`.

Weights by kind, each row's elements from the config's shapes (engine/v4 module docstrings)
under V4's split rules (the engine's table is :mod:`engine.v4.tp`; :data:`SPLITS` names them
per row): attention's query side splits by heads over TP (``q_b_proj`` rows and the sinks;
``q_a_proj``, ``kv_proj`` and the norms are whole: one shared K=V head), the grouped output
projection by whole groups (``o_a_proj`` by its ``o_groups x o_lora_rank`` output rows,
``o_b_proj`` by the same input columns; with tp > o_groups each group over tp / o_groups
ranks: o_a by its input columns, o_b whole per group; then an all-reduce); the compressors and CSA's
lightning indexer and mHC are whole on every TP rank; routed experts split by intermediate
over TP, or whole over EP (hash-routed layers too: ``tid2eid`` picks experts, the experts are
the same kind); the shared expert by intermediate over TP, EP or not (what
:mod:`engine.v4.moe` builds, as V3's EP keeps its shared experts' TP rules); embedding and
lm_head by vocab.

KV: the pools :func:`engine.v4.runner.serving_pools` allocates, one per KV group of
:func:`engine.kv_groups.kv_groups` (the window's raw K=V, per compressed kind its entries
with the indexer keys), each ``blocks x block_size`` rows of the group's ``row_elements``,
the blocks :func:`engine.pool_plan.plan_pools` gives it for the role's request shape
(:func:`pool_plan`: what the rank's runner gets); the compressors' open-group state lives in
each request's objects (one per state block: the requests the pools hold). Every width comes
from :mod:`engine.v4.kv_spec`. What ONE request holds is :func:`kv_bytes_per_request` (the
spec's rows at ``n`` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_layer_spec import held_bytes
from engine.kv_groups import kv_groups
from engine.quant.fp8_block import block_grid
from engine.v4.config import CSA, HASH_MOE, HCA, SLIDING, V4Config
from engine.v4.kv_spec import PER_ENTRY, PER_REQUEST, PER_TOKEN, layer_specs
from engine.pool_plan import PoolPlan, RequestShape, plan_pools
from engine.v4.staging import staging_bytes_per_slot
from orchestrator.config.memory_plan import DTYPE_BYTES, PlanRow, Precision, RolePlan
from orchestrator.config.role_layout import RoleLayout

FP4_BYTES = 0.5 + 1 / 32  # NOTE: e2m1 pairs + one e8m0 scale per 32 (engine Mxfp4Experts)
ID_BYTES = 8  # tid2eid expert ids, int64 as engine/v4/moe.py registers them

SPLITS = {"attention": "q_b by heads /tp; q_a, kv whole",
          "grouped output projection": "groups /tp", "compressors + indexer": "whole",
          "indexer q_b": "whole", "mHC": "whole", "shared expert": "intermediate /tp",
          "routed experts": "/tp or EP", "embedding": "vocab /tp", "lm_head": "vocab /tp",
          "FP8 block scales": "as their weights"}


@dataclass(frozen=True)
class V4Precision(Precision):
    """:class:`Precision` plus ``expert``: bytes per routed-expert weight (FP4 in the release);
    ``fp8_block``: the FP8 linears' scale block when kept FP8 (None: dequantized);
    ``expert_scales``: the routed experts are FP8 blocks too (their scales counted with the
    linears')."""

    expert: float = 2.0
    fp8_block: tuple[int, int] | None = None
    expert_scales: bool = False

    @classmethod
    def for_checkpoint(cls, raw: dict, dtype: str, fp8_storage: str) -> "V4Precision":
        """What engine/v4 holds (:mod:`engine.v4.stored`): with ``model.fp8_storage: fp8`` and
        an FP8 ``quantization_config`` the linears 1 byte (+ a float32 scale per block, the
        ``FP8 block scales`` row) and the routed experts as ``expert_dtype`` says (fp4: packed
        MXFP4, :data:`FP4_BYTES`; bf16: ``dtype``; else FP8 blocks); else all at ``dtype``."""
        size = DTYPE_BYTES[dtype]
        qc = raw.get("quantization_config") or {}
        if fp8_storage != "fp8" or qc.get("quant_method") != "fp8":
            return cls(linear=size, weight=size, kv=size, activation=size, expert=size)
        kind = raw.get("expert_dtype") or qc.get("expert_dtype")
        expert = FP4_BYTES if kind == "fp4" else size if kind in ("bf16", "bfloat16") else 1.0
        return cls(linear=1.0, weight=size, kv=size, activation=size, expert=expert,
                   fp8_block=tuple(qc.get("weight_block_size", (128, 128))),
                   expert_scales=expert == 1.0)


def _tp_divides(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"tp {tp} does not divide DeepSeek-V4's {what} ({n}): pick a tp that "
                         "divides it")
    return n // tp


def attention_layer(m: V4Config, tp: int = 1) -> int:
    """One layer's q_a, q_b, kv_proj on one of ``tp`` ranks: q_b by heads / tp, the rest
    whole (the q_a / kv norms and the sinks: :func:`attention_extras`)."""
    return sum(o * i for o, i in _attention_shapes(m, tp))


def attention_extras(m: V4Config, tp: int = 1) -> int:
    """One layer's q_a_norm, kv_norm and sinks (by heads / tp): model precision."""
    return m.q_lora_rank + m.head_dim + m.num_attention_heads // tp


def _attention_shapes(m: V4Config, tp: int) -> list[tuple[int, int]]:
    """Local ``[out, in]`` of q_a, q_b, kv_proj."""
    heads = _tp_divides(m.num_attention_heads, tp, "num_attention_heads")
    h = m.hidden_size
    return [(m.q_lora_rank, h), (heads * m.head_dim, m.q_lora_rank), (m.head_dim, h)]


def output_layer(m: V4Config, tp: int) -> int:
    """One layer's ``o_a_proj [g * o_lora, H * D / g]`` + ``o_b_proj [hidden, g * o_lora]`` on
    one of ``tp`` ranks: ``g / tp`` whole groups, or with tp > g a ``g / tp`` share of one
    group's o_a and that group's whole o_b (:func:`engine.v4.tp.output_groups`)."""
    if m.o_groups % tp and tp % m.o_groups:
        raise ValueError(f"tp {tp} and DeepSeek-V4's o_groups ({m.o_groups}): one must divide "
                         "the other: pick such a tp")
    return sum(o * i for o, i in _output_shapes(m, tp))


def _output_shapes(m: V4Config, tp: int) -> list[tuple[int, int]]:
    """Local ``[out, in]`` of o_a and o_b (:func:`engine.v4.tp.output_groups`)."""
    groups, sharing = max(m.o_groups // tp, 1), max(tp // m.o_groups, 1)
    o_a = (groups * m.o_lora_rank, m.num_attention_heads * m.head_dim // m.o_groups // sharing)
    return [o_a, (m.hidden_size, groups * m.o_lora_rank)]


def compressor_layer(m: V4Config, kind: str) -> int:
    """One layer's compressor (``kv_proj``, ``gate_proj [coff * D, hidden]``, ``position_bias
    [ratio, coff * D]``, ``kv_norm``) and, CSA, its indexer (its own compressor at
    ``index_head_dim`` + ``weights_proj``; its ``q_b_proj`` is :func:`indexer_q_b`, an FP8
    linear in the release); 0 for sliding layers: model precision."""
    if kind == SLIDING:
        return 0
    ratio, h = dict(m.compress_rates)[kind], m.hidden_size

    def one(width: int, coff: int) -> int:
        return 2 * coff * width * h + ratio * coff * width + width

    if kind == HCA:
        return one(m.head_dim, 1)
    c_i, n_i = m.index_head_dim, m.index_n_heads
    return one(m.head_dim, 2) + one(c_i, 2) + h * n_i


def indexer_q_b(m: V4Config, kind: str) -> int:
    """A CSA layer's indexer ``q_b_proj [n_h x c_I, q_lora]`` (whole); 0 elsewhere."""
    return m.index_n_heads * m.index_head_dim * m.q_lora_rank if kind == CSA else 0


def hc_block(m: V4Config) -> int:
    """One mHC (``fn [(2 + N) N, N h]``, ``base``, ``scale [3]``)."""
    n = m.hc_mult
    return (2 + n) * n * (n * m.hidden_size + 1) + 3


def expert(m: V4Config, tp: int) -> int:
    """One routed expert (gate_up ``[2I, h]``, down ``[h, I]``) with its intermediate / tp."""
    return 3 * m.hidden_size * _tp_divides(m.moe_intermediate_size, tp,
                                           "moe_intermediate_size")


def experts_held(m: V4Config, lay: RoleLayout) -> int:
    """Routed experts one rank holds per layer (EP: ``n / ep_size`` whole)."""
    if not lay.ep:
        return m.n_routed_experts
    return _tp_divides(m.n_routed_experts, lay.ep_size, "n_routed_experts over EP")


def router_layer(m: V4Config, layer: int) -> int:
    """Gate weight ``[E, h]`` (+ ``e_score_correction_bias [E]`` on top-k layers; hash
    layers' ``tid2eid`` is its own row, :data:`ID_BYTES` each)."""
    gate = m.n_routed_experts * m.hidden_size
    return gate if m.mlp_layer_types[layer] == HASH_MOE else gate + m.n_routed_experts


def decoder_layer(m: V4Config, layer: int, kind: str, lay: RoleLayout) -> dict[str, int]:
    """One decoder layer's weights on one rank by plan row."""
    h = m.hidden_size
    return {"attention": attention_layer(m, lay.tp),
            "grouped output projection": output_layer(m, lay.tp),
            "compressors + indexer": compressor_layer(m, kind),
            "indexer q_b": indexer_q_b(m, kind), "mHC": 2 * hc_block(m),
            "shared expert": expert(m, lay.tp),
            "routed experts": experts_held(m, lay) * expert(m, 1 if lay.ep else lay.tp),
            "norms + router": 2 * h + attention_extras(m, lay.tp) + router_layer(m, layer),
            "hash router tid2eid": m.vocab_size * m.num_experts_per_tok
            if m.mlp_layer_types[layer] == HASH_MOE else 0}


def _weights(m: V4Config, lay: RoleLayout) -> dict[str, int]:
    out: dict[str, int] = {}
    for layer, kind in enumerate(m.layer_types):
        for name, n in decoder_layer(m, layer, kind, lay).items():
            out[name] = out.get(name, 0) + n
    vocab = _tp_divides(m.vocab_size, lay.tp, "vocab_size") * m.hidden_size
    out["embedding"], out["lm_head"] = vocab, 0 if m.tie_word_embeddings else vocab
    out["norms + router"] += m.hidden_size + m.hc_mult * (m.hc_mult * m.hidden_size + 1) + 1
    if lay.mtp:  # NOTE: one sliding layer (mtp.0) + e_proj, h_proj, enorm, hnorm, norm, hc head
        mtp = sum(decoder_layer(m, m.num_hidden_layers - 1, SLIDING, lay).values())
        h = m.hidden_size
        out["MTP layer (speculative)"] = mtp + 2 * h * h + 3 * h + \
            m.hc_mult * (m.hc_mult * h + 1) + 1
    return out


_STORAGE = {"routed experts": "expert", "embedding": "weight", "lm_head": "weight",
            "norms + router": "weight", "mHC": "weight", "hash router tid2eid": "byte",
            "compressors + indexer": "weight"}


def fp8_shapes(m: V4Config, lay: RoleLayout, experts: bool) -> list[tuple[int, int]]:
    """Local ``[out, in]`` of every FP8 linear one rank holds (the release's set,
    :data:`engine.v4.stored.RELEASE_FP8`: q_a, q_b, kv, o_a, o_b, the CSA indexers' q_b, the
    shared expert; with ``experts`` each held routed expert's fused gate_up ``[2I, h]`` and
    down ``[h, I]``, as :class:`engine.quant.fp8_block.Fp8BlockExperts` stacks them)."""
    inter = _tp_divides(m.moe_intermediate_size, lay.tp, "moe_intermediate_size")
    shared = [(inter, m.hidden_size)] * 2 + [(m.hidden_size, inter)]
    one = _attention_shapes(m, lay.tp) + _output_shapes(m, lay.tp) + shared
    out = []
    for kind in m.layer_types:
        out += one
        if kind == CSA:
            out.append((m.index_n_heads * m.index_head_dim, m.q_lora_rank))
        if experts:
            i_e = m.moe_intermediate_size if lay.ep else inter
            out += [(2 * i_e, m.hidden_size), (m.hidden_size, i_e)] * experts_held(m, lay)
    return out


def fp8_scale_blocks(m: V4Config, lay: RoleLayout, prec: V4Precision) -> int:
    """Float32 block scales one rank holds with FP8 kept (0 when dequantized): the block grid
    of each :func:`fp8_shapes` weight (ceil division, as the engine's buffers)."""
    if prec.fp8_block is None:
        return 0
    grids = (block_grid(o, i, prec.fp8_block) for o, i in fp8_shapes(m, lay, prec.expert_scales))
    return sum(r * c for r, c in grids)


def _weight_rows(m: V4Config, lay: RoleLayout, prec: V4Precision) -> list[PlanRow]:
    rows = []
    for name, n in _weights(m, lay).items():
        if not n:
            continue
        split = SPLITS.get(name, "whole")
        if name == "routed experts":
            split = (f"{experts_held(m, lay)} of {m.n_routed_experts} whole (EP {lay.ep_size})"
                     if lay.ep else f"all {m.n_routed_experts}, intermediate /{lay.tp}")
        storage = _STORAGE.get(name, "linear")
        per = ID_BYTES if storage == "byte" else getattr(prec, storage)
        rows.append(PlanRow(name, "weights", n, per, split))
    scales = fp8_scale_blocks(m, lay, prec)
    if scales:
        rows.append(PlanRow("FP8 block scales", "weights", scales, prec.fp32,
                            f"one per {prec.fp8_block[0]} x {prec.fp8_block[1]} block, "
                            "float32, as their weights"))
    return rows


_SHORT = {CSA: "CSA", HCA: "HCA"}


def pool_plan(m: V4Config, lay: RoleLayout) -> PoolPlan:
    """The group pools one rank of ``lay`` builds (:func:`engine.pool_plan.plan_pools` of
    what the rank's runner gets: ``num_kv_blocks``, ``block_size``, ``max_num_seqs`` requests
    of ``max_model_len`` written ``chunk_size`` tokens a step)."""
    return plan_pools(layer_specs(m), lay.num_kv_blocks, lay.block_size,
                      RequestShape(lay.max_num_seqs, lay.max_model_len, lay.chunk_size))


def _kv_rows(m: V4Config, lay: RoleLayout, prec: V4Precision) -> list[PlanRow]:
    pools = pool_plan(m, lay)
    out = []
    for g in kv_groups(layer_specs(m)):
        if g.per == PER_REQUEST:
            continue
        kind = g.name.split("/", 1)[-1]
        label = "window" if g.per == PER_TOKEN else f"{_SHORT[kind]} entries 1/{g.compress_ratio}"
        what = "raw K=V" if g.per == PER_TOKEN else \
            "K=V + index keys" if kind == CSA else "K=V"
        out.append(PlanRow(f"KV: {label}", "kv", pools.elements(g.name), prec.kv,
                           f"{pools.blocks[g.name]} blocks x {lay.block_size} rows x "
                           f"{g.row_elements:,} ({what}, {len(g.layers)} layers)"))
    state = [g.name for g in kv_groups(layer_specs(m)) if g.per == PER_REQUEST]
    held = max(pools.blocks[g] for g in state)  # NOTE: every state group: one per request
    out.append(PlanRow("KV: compressor state", "kv", sum(pools.elements(g) for g in state),
                       prec.kv, f"{held} requests x {sum(pools.row_elements[g] for g in state):,}"))
    if lay.staging_blocks:
        slot = staging_bytes_per_slot(m, 1)
        out.append(PlanRow("KV: PD staging rows", "kv", lay.staging_blocks * lay.block_size
                           * slot, prec.kv, f"{lay.staging_blocks} blocks x {lay.block_size} "
                           f"rows x {slot:,} (every layer's staged row)"))
    return out


def pools_line(m: V4Config, lay: RoleLayout) -> str:
    """One report line: what the rank's group pools hold (:func:`pool_plan`) and why."""
    pools = pool_plan(m, lay)
    why = (f"max_num_seqs {lay.max_num_seqs}; num_kv_blocks' budget would hold "
           f"{pools.budget_requests:.1f}" if pools.capped else
           f"num_kv_blocks {lay.num_kv_blocks}'s budget; max_num_seqs {lay.max_num_seqs}")
    per = ", ".join(f"{g} {pools.per_request[g]}" for g in pools.blocks)
    return (f"  V4 KV pools: {pools.requests:.4g} requests of max_model_len "
            f"{lay.max_model_len:,} ({why}); blocks per request: {per}")


def _workspace_rows(m: V4Config, lay: RoleLayout, prec: V4Precision) -> list[PlanRow]:
    # NOTE: an estimate of one layer's live tensors per step token (reused layer to layer),
    # fused attention kernels holding no score matrix: the hc_mult residual streams twice
    # (in, out), 4 hidden-wide tensors, q latent, q and attention output on all heads, kv,
    # the compressor projections (2 x coff x D, CSA indexer at 2 x 2 x c_I) and per routed
    # choice its dispatched copy in and out plus gate, up and the SwiGLU product.
    inter = m.moe_intermediate_size // (1 if lay.ep else lay.tp)
    per_token = (2 * m.hc_mult + 4) * m.hidden_size + m.q_lora_rank \
        + 2 * m.num_attention_heads * m.head_dim + m.head_dim + 4 * m.head_dim \
        + 4 * m.index_head_dim + m.num_experts_per_tok * (2 * m.hidden_size + 3 * inter)
    mine = -(-lay.step_tokens // lay.cp)
    return [PlanRow("workspace: activations", "workspace", mine * per_token, prec.activation,
                    f"{lay.step_tokens} step tokens (estimate)"),
            PlanRow("workspace: logits", "workspace", lay.max_num_seqs * m.vocab_size, prec.fp32,
                    f"{lay.max_num_seqs} seqs x full vocab, fp32")]


def _comm_rows(lay: RoleLayout) -> list[PlanRow]:
    names = lay.collectives
    rows = [PlanRow("comm: KV pair groups", "communicators",
                    lay.pair_groups * lay.pair_buffer_bytes, 1.0,
                    f"{lay.pair_groups} KV pair group(s) x {lay.pair_buffer_bytes / 1e6:g} MB"),
            PlanRow("comm: TP/EP/CP groups", "communicators",
                    len(names) * lay.comm_buffer_bytes, 1.0,
                    f"{' + '.join(names) or 'none'} x {lay.comm_buffer_bytes / 1e6:g} MB")]
    return [r for r in rows if r.elements]


def plan_role_v4(model: V4Config, layout: RoleLayout, precision: V4Precision) -> RolePlan:
    """What one rank of ``layout``'s role holds (module docstring).

    Raises:
        ValueError: tp does not divide ``num_attention_heads``, ``moe_intermediate_size``
            (ep off) or ``vocab_size``, or neither tp nor ``o_groups`` divides the other; the
            EP size does not divide ``n_routed_experts``. The message starts with the role's
            config key (``decode.tp=3: ...``, ``decode.ep: ...``; a colocated role's is
            ``decode``).
    """
    key = "decode" if layout.role == "colocated" else layout.role  # NOTE: its config section
    if layout.ep and model.n_routed_experts % layout.ep_size:
        raise ValueError(
            f"{key}.ep: the expert-parallel size {key}.dp x {key}.tp = {layout.dp} x "
            f"{layout.tp} = {layout.ep_size} does not divide DeepSeek-V4's n_routed_experts "
            f"({model.n_routed_experts}): pick a dp x tp that divides it, or set {key}.ep false")
    try:
        weights = _weight_rows(model, layout, precision)
    except ValueError as exc:  # NOTE: a size tp does not split: name the key to change
        raise ValueError(f"{key}.tp={layout.tp}: {exc}") from None
    rows = weights + _kv_rows(model, layout, precision) \
        + _workspace_rows(model, layout, precision) + _comm_rows(layout)
    return RolePlan(layout, tuple(rows))


def kv_elements_per_request(m: V4Config, num_tokens: int) -> dict[str, int]:
    """Elements one request of ``num_tokens`` tokens holds, by tensor kind, summed over the
    layers (:meth:`engine.v4.kv_spec.V4LayerSpec.rows` of each tensor): ``window`` (the last
    ``sliding_window - 1`` raw K=V), ``entries`` (compressed K=V + CSA index keys),
    ``state`` (the compressors' open groups)."""
    out = {"window": 0, "entries": 0, "state": 0}
    key = {PER_TOKEN: "window", PER_ENTRY: "entries", PER_REQUEST: "state"}
    for spec in layer_specs(m):
        for t in spec.tensors():
            out[key[t.per]] += spec.rows(t, num_tokens) * t.width
    return out


def kv_bytes_per_request(m: V4Config, num_tokens: int, kv_bytes: float) -> float:
    """Bytes one request of ``num_tokens`` tokens holds (and PD ships), every layer: the
    spec's rows x widths x ``kv_bytes`` (:func:`engine.kv_layer_spec.held_bytes`, as V3's)."""
    return held_bytes(layer_specs(m), num_tokens, kv_bytes)


def request_line(m: V4Config, max_model_len: int, kv_bytes: float) -> str:
    """One report line: a request's KV at ``max_model_len`` by kind, and what 1K more tokens
    add past the window (compressed entries only)."""
    parts = kv_elements_per_request(m, max_model_len)
    total = sum(parts.values()) * kv_bytes
    grow = kv_bytes_per_request(m, max_model_len + 1024, kv_bytes) - total
    text = ", ".join(f"{k} {v * kv_bytes / 1e6:.3g}" for k, v in parts.items())
    return (f"  KV per request at max_model_len {max_model_len:,}: {total / 1e6:.4g} MB "
            f"({text}); +{grow / 1e6:.3g} MB per 1K more tokens (compressed entries only: "
            f"the window stays {m.sliding_window - 1} tokens)")


__all__ = ["FP4_BYTES", "SPLITS", "V4Precision", "kv_bytes_per_request",
           "kv_elements_per_request", "plan_role_v4", "pool_plan", "pools_line", "request_line"]
