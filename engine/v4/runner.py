"""The model runner of a DeepSeek-V4 checkpoint: :class:`V4Runner`, the interface of
:class:`engine.runner.ModelRunner` (``execute(steps)`` -> ``[B, vocab]`` logits) over
:mod:`engine.v4` and its paged caches per KV group.

The rows live in the V4 groups' pools (:func:`serving_pools`, each sized by
:func:`engine.pool_plan.plan_pools` for the rank's request shape), taken as each request grows
(:meth:`engine.v4.block_table.RequestBlocks.grow`) and, for the sliding window, given back as
decode advances. The rank's scheduler admits a request only when its most blocks per group
fit next to the admitted ones' (:meth:`V4Runner.make_admission`,
:mod:`engine.v4.admission`); its own pool then holds only the request's staging rows (PD) or
one block (colocated). A request's V4 blocks and commitment go back when the scheduler frees
its block set (:meth:`V4Runner.release`, wired to the scheduler pool's free; the blocks before
the next step or rebuild, both of which apply releases first: :mod:`engine.v4.request_caches`,
which also says how they reach every TP rank).

TP (:mod:`engine.v4.tp`): query heads, the grouped output projection, every expert's
intermediate channels (routed ones only without EP) and the vocabulary split over the rank's
TP group; K=V, the compressors
and the indexer are whole, so every TP rank holds the WHOLE V4 cache (the same on each: every
rank runs every step, the rank's SPMD step channel).

PD (any prefill tp -> any decode tp): a PD role's first use of :attr:`V4Runner.kv_cache` makes
the staging cache (:mod:`engine.v4.staging`); prefill stages, after each chunk, the rows of a
request's state that chunk made final (:meth:`V4Runner.chunk_rows`, :meth:`V4Runner.stage_rows`,
:mod:`engine.v4.row_layout`: entries and final-window rows chunk by chunk, the open-group state
with the last; every prefill rank: each holds the whole state), the transfer moves those rows
as it moves MLA's replicated latent (each prefill rank sends its planned layers, every decode
rank gets every layer: :mod:`kv_transfer.plan`), every decode rank rebuilds the request's
paged cache from them (:meth:`V4Runner.admit_staged`).

EP (an :class:`engine.parallel.EPGroup` of size > 1 over the role's dp x tp ranks, as V3's):
the rank holds only its whole routed experts (:mod:`engine.v4.expert_parallel`; under TP each
TP rank dispatches a slice of the tokens); every DP rank of the group runs
:meth:`V4Runner.execute` or :meth:`V4Runner.execute_empty` on all its ranks each step, in
lockstep (the rank's DP sync, rank/dp_sync.py, as for V3). EP leaves the V4 cache alone.

Not supported yet (refused by :func:`check_v4_serving`): CP, layer sharding, graph mode, MTP,
the prefix cache, per-layer KV streaming (rows ship after each chunk's step, not during its
forward).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.block_pool import BlockPool, BlockSet
from engine.parallel import EPGroup, TPGroup
from engine.pool_plan import PoolPlan, RequestShape, plan_pools
from engine.v4.admission import V4Admission
from engine.v4.config import V4Config
from engine.v4.expert_parallel import exchange_empty
from engine.v4.loader import load_v4
from engine.v4.kv_spec import layer_specs
from engine.v4.paged_cache import PagedKV, PagedV4Cache
from engine.v4.request_caches import RequestCaches
from engine.v4.kv_spec import layer_specs
from engine.v4.row_layout import RowRange, chunk_rows, kind_layout, layer_rows, pack_rows
from engine.v4.staging import StagingCache, StagingSpec, layout_text, staged_rows, tiers, unpack
from engine.v4.state_io import cache_reader, export_request

V4_MODEL_TYPE, V4_ARCHITECTURE = "deepseek_v4", "DeepseekV4ForCausalLM"


def is_v4_config(raw: dict) -> bool:
    """True when a parsed config.json is DeepSeek-V4 (``model_type`` or ``architectures``)."""
    return raw.get("model_type") == V4_MODEL_TYPE or \
        (raw.get("architectures") or [None])[0] == V4_ARCHITECTURE


def is_v4_checkpoint(checkpoint_dir: str | Path) -> bool:
    """True when ``checkpoint_dir/config.json`` is DeepSeek-V4 (False when it is missing)."""
    path = Path(checkpoint_dir) / "config.json"
    return path.is_file() and is_v4_config(json.loads(path.read_text()))


def v4_unsupported(*, cp: int = 1, graph: bool = False,
                   num_speculative_tokens: int = 0, layer_sharding: tuple[str, ...] = (),
                   prefix_cache: bool = False) -> list[str]:
    """What of a serving layout DeepSeek-V4 does not support yet, each with its fix (empty:
    all supported). TP and EP are supported (their sizes are checked at load,
    :func:`engine.v4.tp.check_tp`, :func:`engine.layout.expert_range`)."""
    out = []
    for on, what in ((cp > 1, f"cp={cp} (set cp to 1)"),
                     (cp > 1, f"cp={cp} (set cp to 1)"),
                     (bool(layer_sharding), "layer_sharding (remove it)"),
                     (graph, "graph mode (set decode.graph.enabled false)"),
                     (num_speculative_tokens > 0, "MTP (remove decode.speculative)"),
                     (prefix_cache, "the prefix cache (set prefix_cache false)")):
        if on:
            out.append(what)
    return out


def check_v4_serving(**layout: object) -> None:
    """Raise ValueError naming every unsupported part of ``layout`` (:func:`v4_unsupported`)."""
    bad = v4_unsupported(**layout)
    if bad:
        raise ValueError("DeepSeek-V4 (model_type deepseek_v4) is served with TP and EP "
                         "(colocated, or PD across any tp); not supported yet: "
                         + "; ".join(bad))


@dataclass(frozen=True)
class V4ServedConfig:
    """What the rank reads off ``runner.model_config``: EOS ids, context limit, layers,
    hidden size (the decode role's MTP input check reads it)."""

    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    num_hidden_layers: int
    hidden_size: int


def serving_pools(plan: PoolPlan) -> dict[str, BlockPool]:
    """One :class:`BlockPool` per KV group (:func:`engine.kv_groups.kv_groups`) of
    ``plan.blocks[group]`` blocks of ``plan.block_sizes[group]`` rows
    (:func:`engine.pool_plan.plan_pools`: sized by the request shape; state groups 1 row).

    NOTE: never short for admitted requests: the scheduler admits by these pools
    (:class:`engine.v4.admission.V4Admission`).
    """
    return {name: BlockPool(n, plan.block_sizes[name]) for name, n in plan.blocks.items()}


class V4Runner:
    """Model + paged V4 caches of one rank, keyed by request id (under TP this rank's part of
    the model, :mod:`engine.v4.tp`, and the whole V4 cache: every TP rank holds the same; with
    ``ep`` only its routed experts).

    Args:
        checkpoint_dir: a DeepSeek-V4 HF checkpoint directory.
        num_kv_blocks, block_size: the V4 KV budget (``num_kv_blocks`` blocks in every
            stored group) and rows per block (state groups 1 row); block_size is the
            scheduler pool's.
        shape: the requests the group pools are sized for (:func:`engine.pool_plan.
            plan_pools`: the budget split in proportion to what they hold per group, at most
            ``max_num_seqs`` of them; what the memory plan prints); None: every group
            ``num_kv_blocks`` blocks.
        dtype, device: weights, activations and cache.
        tp: this rank's TP group (None: one rank); every rank of the group runs the same
            steps (the rank's SPMD step channel).
        staging_blocks: blocks of the PD staging cache and of the scheduler pool that
            addresses it (:attr:`scheduler_blocks`; 0: ``num_kv_blocks``): they hold only the
            staging rows of the requests in flight (:func:`engine.v4.staging.staging_bytes`).
        fp8_storage: a quantized checkpoint's FP8 linears and FP4 / FP8 routed experts
            "dequantize"d at load or kept as stored ("fp8", :mod:`engine.v4.stored`).
        ep: this rank's :class:`EPGroup` (None: EP off; all dp x tp ranks of the role). With
            it the rank holds only its whole routed experts, and every rank of the group calls
            :meth:`execute` or :meth:`execute_empty` each step, in lockstep.
        layout: the rest of the serving layout (``cp``, ``graph``,
            ``num_speculative_tokens``, ``layer_sharding``), checked by
            :func:`check_v4_serving`.

    Raises:
        ValueError: an unsupported layout; a TP size the model's sizes refuse
            (:func:`engine.v4.tp.check_tp`); ``ep.size`` does not divide
            ``n_routed_experts``. CheckpointError: from :func:`load_v4`.
    """

    def __init__(self, checkpoint_dir: str | Path, *, num_kv_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 staging_blocks: int = 0, tp: TPGroup | None = None,
                 ep: EPGroup | None = None, shape: RequestShape | None = None,
                 fp8_storage: str = "dequantize", **layout: object) -> None:
        check_v4_serving(**layout)
        self.device, self.tp, self.ep = torch.device(device), tp or TPGroup(), ep or EPGroup()
        self.model = load_v4(checkpoint_dir, dtype, self.device, tp=self.tp, ep=self.ep,
                             fp8_storage=fp8_storage).eval()
        raw = json.loads((Path(checkpoint_dir) / "config.json").read_text())
        eos = raw.get("eos_token_id")
        config = self.model.config
        self.model_config = V4ServedConfig(
            () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),),
            config.max_position_embeddings, config.num_hidden_layers, config.hidden_size)
        self.pools = serving_pools(plan_pools(layer_specs(config), num_kv_blocks, block_size,
                                              shape))
        self.dtype = dtype
        self.scheduler_blocks = staging_blocks or num_kv_blocks
        self.staging_spec = StagingSpec(config.num_hidden_layers, self.scheduler_blocks,
                                        block_size, tiers(config), dtype, layout_text(config))
        self._staging: StagingCache | None = None
        self.kv = PagedKV(config, self.pools, dtype, self.device)
        self.requests = RequestCaches(self.tp.size)
        self.caches = self.requests.caches  # request id -> PagedV4Cache
        self.admission: V4Admission | None = None

    def make_admission(self, block_size: int, *, staged: bool) -> V4Admission:
        """The scheduler's admission budget over this runner's group pools
        (:class:`engine.v4.admission.V4Admission`; ``block_size``: the scheduler pool's,
        ``staged``: a PD role); :meth:`release` gives its commitments back."""
        self.admission = V4Admission(self.model.config, self.pools, block_size, staged=staged)
        return self.admission

    def group_blocks(self) -> tuple[tuple[str, int, int], ...]:
        """(group, free blocks, total blocks) of each KV group's pool, in
        :func:`engine.kv_groups.kv_groups` order (what ``orch status`` and
        ``orch_kv_group_blocks`` show). Any thread: each count is read once, so a step running
        meanwhile may make the groups' counts a few blocks apart in time."""
        return tuple((name, pool.num_free_blocks, pool.num_blocks)
                     for name, pool in self.pools.items())

    def release(self, block_set: BlockSet) -> None:
        """The scheduler pool freed ``block_set``: its commitment goes back now, its request's
        V4 blocks before the next step or rebuild (any thread; the step's thread frees them,
        and each step or rebuild applies releases before it takes blocks). Under TP only the
        leader's pool calls this (:mod:`engine.v4.request_caches`)."""
        self.requests.release(block_set.block_ids[0])
        if self.admission is not None:
            self.admission.release(block_set)

    def take_releases(self) -> tuple[str, ...]:
        """Leader under TP: the request ids released since the last call, for every rank's
        :meth:`free_requests` (:meth:`engine.v4.request_caches.RequestCaches.take_releases`).
        The step's thread only."""
        return self.requests.take_releases()

    def free_requests(self, request_ids: tuple[str, ...]) -> None:
        """Free the caches of the leader's released ``request_ids`` (each once; unknown ids
        skipped). The step's thread only."""
        self.requests.free_requests(request_ids)

    def apply_releases(self) -> None:
        """Tp 1: free the caches of what :meth:`release` recorded (each once); under TP a
        no-op (the leader's step or idle loop frees them on every rank,
        :mod:`engine.v4.request_caches`). The step's thread only: each step and rebuild
        calls it first, the rank's idle loop too (``rank.rank.Rank.free_idle_releases``)."""
        self.requests.apply_releases()

    @torch.inference_mode()
    def execute(self, steps: list, on_kv_written: Callable[[int], None] | None = None
                ) -> torch.Tensor:
        """One step over ``steps`` (:class:`engine.runner.SeqStep`; prefill chunks and
        decode tokens in any mix): ``[B, vocab]`` fp32 logits at each step's last token.

        A step with ``num_computed_tokens == 0`` starts its request's cache; its
        ``block_ids[0]`` names the scheduler block set whose free ends it.

        Raises:
            ValueError: no steps; ``on_kv_written`` given (V4 streams no per-layer KV: its
                rows ship after each chunk's step, :meth:`stage_rows`); a
                step past ``max_position_embeddings``; a step not continuing its request's
                cache (unknown request, or ``num_computed_tokens`` != cached tokens).
        """
        if not steps:
            raise ValueError("execute() needs at least one SeqStep")
        if on_kv_written is not None:
            raise ValueError("DeepSeek-V4 does not stream per-layer KV (its staging rows ship "
                             "after each chunk's step): set transfer.layerwise false")
        self.apply_releases()
        caches = [self._cache_of(s) for s in steps]
        lengths = [len(s.token_ids) for s in steps]
        ids = torch.tensor([t for s in steps for t in s.token_ids], dtype=torch.int64,
                           device=self.device)
        logits = self.model.forward_batch(ids, caches, lengths)
        last = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        return logits[last]

    def _cache_of(self, s) -> PagedV4Cache:
        limit = self.model_config.max_position_embeddings
        if s.num_computed_tokens + len(s.token_ids) > limit:
            raise ValueError(f"request {s.request_id} reaches "
                             f"{s.num_computed_tokens + len(s.token_ids)} tokens; the model's "
                             f"max_position_embeddings is {limit}: shorten the prompt or "
                             "max_tokens")
        cache = self.caches.get(s.request_id)
        if cache is None and s.num_computed_tokens == 0:
            cache = self.requests.add(s.request_id, s.block_ids[0], self.kv.new_request())
        if cache is None or cache.num_tokens != s.num_computed_tokens:
            raise ValueError(f"request {s.request_id}: step at token {s.num_computed_tokens} "
                             f"but its V4 cache holds "
                             f"{'nothing' if cache is None else cache.num_tokens} tokens "
                             "(V4 has no prefix cache)")
        return cache

    def export_request(self, request_id: str) -> list[dict[str, torch.Tensor]]:
        """The request's cache as the per-layer tensors PD would ship
        (:func:`engine.v4.state_io.export_request`).

        Raises:
            KeyError: no cache for ``request_id`` here.
        """
        return export_request(self.caches[request_id])

    def import_request(self, request_id: str, block_ids: tuple[int, ...],
                       layers: list[dict[str, torch.Tensor]], num_tokens: int) -> None:
        """Start ``request_id``'s cache from shipped tensors after ``num_tokens`` tokens (its
        next step has ``num_computed_tokens == num_tokens``); ``block_ids``: its scheduler
        block set, whose free ends it (as a first step's does).

        Raises:
            ValueError: the tensors are not the specs' (:meth:`PagedKV.import_request`).
        """
        self.apply_releases()
        self.requests.add(request_id, block_ids[0], self.kv.import_request(layers, num_tokens))

    @property
    def kv_cache(self) -> StagingCache:
        """The staging cache the KV transfer reads (prefill) or writes (decode), made on first
        use (a PD role's; colocated serving never allocates it): per layer one
        ``[scheduler_blocks, block_size, width]`` buffer per tier it has
        (:func:`engine.v4.staging.tiers`), indexed by the scheduler's slots."""
        if self._staging is None:
            self._staging = StagingCache(self.staging_spec, self.device)
        return self._staging

    @property
    def kv_spec(self) -> StagingSpec:
        """The staging cache's shape (the transfer layout, :func:`rank.kv_setup.make_layout`,
        and the transfer log's byte counts)."""
        return self.staging_spec

    def staged_rows(self, num_tokens: int) -> int:
        """Staging slots a request of ``num_tokens`` prompt tokens takes: the most rows a layer
        ships (:func:`engine.v4.staging.staged_rows`, <= ``num_tokens``)."""
        return staged_rows(self.model.config, num_tokens)

    def layer_rows(self, num_tokens: int) -> tuple[int, ...]:
        """Per layer the staging rows it ships for a ``num_tokens``-token prompt, its kind's
        (:func:`engine.v4.row_layout.layer_rows`: what the decode tracker expects)."""
        return layer_rows(self.model.config, num_tokens)

    def chunk_rows(self, num_tokens: int, start: int, end: int) -> tuple[RowRange, ...]:
        """Prefill leader: the staging rows a chunk of tokens ``[start, end)`` of a
        ``num_tokens``-token prompt makes final, per layer group
        (:func:`engine.v4.row_layout.chunk_rows`: over the prompt's chunks, every row of every
        layer once)."""
        return chunk_rows(self.model.config, num_tokens, start, end)

    def stage_rows(self, request_id: str, num_tokens: int, rows: RowRange, slots,
                   layers: Collection[int] | None = None) -> None:
        """Prefill, after the chunk that made them final: write staging rows ``[rows.start,
        rows.end)`` of the request (of ``num_tokens`` prompt tokens) into the staging cache at
        ``slots`` (int64 ``[rows.end - rows.start]``), for ``rows.layers`` (only those also
        in ``layers``: the ones the transfer plan has this rank send; under TP every rank
        holds the whole state, each sends a part, :mod:`kv_transfer.plan`).

        Raises:
            KeyError: no cache for ``request_id``. ValueError: ``slots`` is not one per row;
                a row is not final yet (:func:`engine.v4.state_io.cache_reader`).
        """
        if slots.numel() != rows.end - rows.start:
            raise ValueError(f"{request_id}: rows [{rows.start}, {rows.end}), "
                             f"{slots.numel()} slots")
        cache, specs = self.caches[request_id], layer_specs(self.model.config)
        out: list[torch.Tensor | None] = [None] * len(specs)
        for i in rows.layers:
            if layers is None or i in layers:
                out[i] = pack_rows(kind_layout(specs[i], num_tokens),
                                   cache_reader(cache, i, num_tokens), rows.start, rows.end,
                                   self.dtype, self.device)
        self.kv_cache.write(slots, out)

    def admit_staged(self, request_id: str, block_ids: tuple[int, ...], slots,
                     num_tokens: int) -> None:
        """Decode: rebuild the request's paged cache from the staging rows at ``slots`` (int64
        ``[staged_rows(num_tokens)]``; each layer's own rows, the first ``layer_rows`` of them,
        what the transfer wrote) after ``num_tokens`` tokens (:meth:`import_request`).

        Raises:
            ValueError: the rows are not the specs' (:func:`engine.v4.staging.unpack`).
            NoFreeBlocksError: a V4 group's pool is short (nothing taken).
        """
        rows = self.kv_cache.read(slots, self.layer_rows(num_tokens))
        self.import_request(request_id, block_ids, unpack(self.model.config, rows, num_tokens),
                            num_tokens)

    def discard(self, request_id: str) -> None:
        """Free ``request_id``'s cache now if it has one (once; a later release of its block
        set finds no owner): a decode request aborted while its cache was rebuilt."""
        self.apply_releases()
        self.requests.free_requests((request_id,))

    @torch.inference_mode()
    def execute_empty(self) -> None:
        """A zero-token step: only this rank's part of every layer's EP all-to-alls
        (:func:`engine.v4.expert_parallel.exchange_empty`), so that the other DP ranks' step
        completes; a DP rank with no work in a lockstep step calls this. No-op without EP.
        Touches no cache and applies no releases."""
        if self.ep.size > 1:
            exchange_empty(self.model)

    def num_live_requests(self) -> int:
        """Requests holding V4 blocks (released ones count until the next step, or the
        rank's loop going idle, applies the release)."""
        return len(self.caches)
