"""ModelRunner: the entry point the prefill and decode workers call, one per rank.

SPMD: every TP (or CP) rank of an instance builds a runner over the same checkpoint and calls
:meth:`ModelRunner.execute` with the same steps each iteration; all ranks return the same
logits. Under context parallel (``cp``, prefill) each rank computes its share of every step's
tokens and every rank's cache ends up holding all of them (:mod:`engine.context_parallel`). The
runner owns the model and this rank's KV cache; the caller (the worker's scheduler) owns the
block tables and the block pool. With graph mode (``graph.enabled``) decode-only steps run
a forward captured per batch-size bucket (:mod:`engine.graph`; speculative steps: per
token-count bucket); with prefill graph mode (``prefill_graph.enabled``) prefill-only steps
run the layers compiled once for any token count (:mod:`engine.prefill_graph`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.context_parallel import build_cp_step
from engine.decode_step_cache import DecodeStepCache
from engine.forward_context import AttentionMetadata, BlockTableCache, build_attention_metadata
from engine.graph import DecodeGraphs, GraphConfig, mark_context_dynamic, opaque_mla_decode
from engine.prefill_graph import PrefillGraph, PrefillGraphConfig, check_prefill_graph
from engine.layer_sharding import LayerPrefetcher, check_layer_sharding, unowned_params
from engine.kernels import KERNELS, KernelSet
from engine.kv_cache import KVCache, KVCacheSpec
from engine.kv_groups import KV
from engine.kv_layer_spec import mla_layer_specs
from engine.loader import load_weights
from engine.model import build_model
from engine.model_config import ModelConfig, load_model_config
from engine.moe import MoE
from engine.parallel import CPGroup, EPGroup, TPGroup
from engine.quant.load import quant_plan
from engine.platform import detect_platform
from engine.pool_plan import RequestShape, plan_pools
from engine.spec_decode import DraftInput, SpecOutput
from engine.spec_forward import SpecForward

if TYPE_CHECKING:
    from engine.v4.runner import V4Runner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeqStep:
    """One request's work in a step.

    Attributes:
        request_id: the request.
        token_ids: tokens to compute this step (a prefill chunk, or 1 decode token).
        num_computed_tokens: tokens of this request already in the KV cache (positions
            ``0..n-1``); this step computes positions ``n .. n + len(token_ids) - 1``.
        block_ids: the request's block table, covering ``n + len(token_ids)`` tokens
            (``+ num_drafts`` when drafting).
        draft: speculative decoding: what the MTP module drafts from (the step then computes
            ``token_ids`` plus its drafts, :mod:`engine.spec_forward`); None otherwise.
        num_drafts: drafts to make this step (at most ``num_speculative_tokens``).
        next_token_id: the token after ``token_ids`` when already known (a prompt chunk
            that is not the last): the MTP module then runs over every row of the chunk.
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_computed_tokens: int
    block_ids: tuple[int, ...]
    draft: DraftInput | None = None
    num_drafts: int = 0
    next_token_id: int | None = None


class ModelRunner:
    """Model + KV cache of one rank.

    Args:
        checkpoint_dir: HF checkpoint directory (config.json, *.safetensors).
        num_kv_blocks: physical KV blocks per layer; block_size: tokens per block.
        dtype: weights, activations and KV cache dtype.
        tp: this rank's :class:`TPGroup` (None: TP=1).
        ep: this rank's :class:`EPGroup` (None: expert parallelism off). With it, the rank
            holds only its routed experts, and every rank of the group must call
            :meth:`execute` or :meth:`execute_empty` each step, in lockstep.
        device: torch device (None: the platform's device ``tp.rank``).
        kernel_choices: kernel name -> variant (e.g. ``{"mla_decode": "naive"}``).
        kernels: an already resolved :class:`KernelSet` (overrides ``kernel_choices``).
        fp8_storage: FP8 checkpoints only: "dequantize" (to ``dtype`` at load) or "fp8"
            (FP8 weights kept, dequantized per block at use); see docs/quantization.md.
        cp: this rank's :class:`CPGroup` (None: context parallel off). Prefill only, with
            tp = 1; every rank of the group calls :meth:`execute` with the same steps (any
            chunk sizes, 1-token ones included). With ``ep`` (EP rank ``dp_rank * cp +
            cp_rank``) each CP rank dispatches its own tokens' MoE rows.
        layer_sharding: attention linears (``engine.layer_sharding.SHARDABLE``) whose layer
            ``i`` weight only CP rank ``i % cp`` stores; broadcast one layer ahead of use.
        graph: graph mode of the decode forward (:class:`engine.graph.GraphConfig`); with it
            the KV cache gets one scratch block (``kv_cache.scratch_block``) for padding rows.
        num_speculative_tokens: k > 0 builds the checkpoint's MTP module and its KV cache
            (the cache's last layer) and makes :meth:`execute` a speculative step returning
            :class:`engine.spec_decode.SpecOutput` (:mod:`engine.spec_forward`; graph
            buckets then count tokens: ``b * (1 + k)``); 0: off.
        prefill_graph: graph mode of prefill-only steps
            (:class:`engine.prefill_graph.PrefillGraphConfig`; dense MLA, no cp, ep,
            speculative decoding); with it the KV cache gets the scratch block too.

    Attributes:
        model_config, kv_spec, kv_cache, platform, device.
        pool_plan: the KV pool's :class:`engine.pool_plan.PoolPlan` (one group, ``kv``, of
            ``num_kv_blocks`` blocks; :attr:`scheduler_blocks`).
        prefetcher: the layer-sharding :class:`LayerPrefetcher` (``prefetcher.stats``: time
            blocked on weight broadcasts), None without layer sharding under cp > 1.
        graphs: the captured decode forwards (:class:`engine.graph.DecodeGraphs`; with
            speculative decoding the verify forward's, buckets in tokens, and
            ``spec.draft_graphs`` the MTP module's), None with graph mode off.
        prefill_graph: the compiled prefill forward (:class:`PrefillGraph`), None when off.

    Raises:
        UnsupportedModelError / CheckpointError: from the config parser / the loader.
        ValueError: cp > 1 with tp > 1; bad ``layer_sharding`` names; graph mode with
            cp > 1; speculative decoding without an MTP module in the checkpoint; prefill
            graph mode with cp > 1, ep > 1, speculative decoding or DSA sparse attention.
        KeyError: graph mode on a device its backend has no implementation for.
    """

    def __init__(self, checkpoint_dir: str | Path, *, num_kv_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, tp: TPGroup | None = None,
                 device: torch.device | str | None = None,
                 kernel_choices: Mapping[str, str] | None = None,
                 kernels: KernelSet | None = None, ep: EPGroup | None = None,
                 fp8_storage: str = "dequantize", cp: CPGroup | None = None,
                 layer_sharding: tuple[str, ...] = (),
                 graph: GraphConfig | None = None, num_speculative_tokens: int = 0,
                 prefill_graph: PrefillGraphConfig | None = None) -> None:
        self.tp, self.ep, self.cp = tp or TPGroup(), ep or EPGroup(), cp or CPGroup()
        graph, prefill_graph = graph or GraphConfig(), prefill_graph or PrefillGraphConfig()
        _check_cp(self.tp, self.cp, graph)
        # NOTE: a given device was decided by the platform already (the orchestrator's
        # OrchConfig.platform()); the runner's platform is that device's, never a second guess.
        self.platform = detect_platform(torch.device(device).type if device is not None else None)
        self.device = torch.device(device) if device is not None \
            else self.platform.device(max(self.tp.rank, self.cp.rank))
        self.model_config = cfg = load_model_config(checkpoint_dir)
        self.kernels = kernels or KERNELS.resolve(self.device.type, kernel_choices)
        if graph.enabled:  # NOTE: paged decode attention: one opaque op of the graph
            self.kernels = replace(self.kernels,
                                   mla_decode=opaque_mla_decode(self.kernels.mla_decode))
        quant = quant_plan(checkpoint_dir, cfg.quantization, fp8_storage)
        sharded = tuple(layer_sharding)
        check_layer_sharding(sharded, cfg)
        skip = unowned_params(cfg.num_hidden_layers, sharded, self.cp)
        _check_spec(cfg, num_speculative_tokens)
        if prefill_graph.enabled:
            check_prefill_graph(cfg, self.cp.size, self.ep.size, num_speculative_tokens)
        self.model = build_model(cfg, self.tp, self.kernels, dtype, self.device, quant,
                                 ep=self.ep, empty=skip, mtp=num_speculative_tokens > 0)
        layers = self.model.model.layers
        # NOTE: a speculative step computes 1 + k one-token rows per sequence: token buckets
        token_graph = graph.in_tokens(1 + num_speculative_tokens)
        if graph.enabled and self.ep.size > 1:  # NOTE: every step, so all EP ranks agree
            _fixed_ep_dispatch(self.model, -(-max(token_graph.batch_sizes) // self.tp.size))
        load_weights(self.model, checkpoint_dir, self.tp, skip=skip)
        self.model.prepare_lm_head()  # NOTE: in a capture the CPU GEMM is one opaque op
        self.prefetcher = None
        if sharded and self.cp.size > 1:
            self.prefetcher = LayerPrefetcher(layers, sharded, self.cp, dtype, self.device)
        self.model.prefetcher = self.prefetcher
        # NOTE: with MTP its cache is one more layer, shipped and fingerprinted with the rest
        mtp = int(num_speculative_tokens > 0)
        # NOTE: sized as V4's group pools are: the layer specs' groups (MLA: one, "kv")
        layers = mla_layer_specs(cfg, mtp)
        self.pool_plan = plan_pools(layers, num_kv_blocks, block_size, None)
        self.kv_spec = KVCacheSpec.from_layer_specs(
            layers, num_blocks=self.pool_plan.blocks[KV],
            block_size=self.pool_plan.block_sizes[KV], dtype=dtype, mtp_layers=mtp)
        self.kv_cache = KVCache(self.kv_spec, self.device,
                                scratch_block=graph.enabled or prefill_graph.enabled)
        self._block_tables = BlockTableCache(self.kv_spec.num_blocks)
        # NOTE: decode-only steps' metadata, updated in place step to step
        self._decode_cache = DecodeStepCache(block_size, self.device)
        self.graphs = DecodeGraphs(self.model.forward, token_graph, self.device.type,
                                   "verify" if num_speculative_tokens else "decode") \
            if graph.enabled else None
        self.spec = None if not num_speculative_tokens else SpecForward(
            self.model, self.kv_cache, num_speculative_tokens, self._inputs, self.ep.size,
            self._captured, self._padding_step, token_graph)
        if graph.enabled and graph.warmup:
            self.warmup_graphs()
        self.prefill_graph = PrefillGraph(self.model, self.kv_cache, prefill_graph,
                                          self.device.type) if prefill_graph.enabled else None
        if prefill_graph.enabled and prefill_graph.warmup:
            self.warmup_prefill_graph()

    @property
    def scheduler_blocks(self) -> int:
        """Blocks of the scheduler's pool (rank/leader.py): the ``kv`` group's, which the
        cache tensors hold (``kv_spec.num_blocks``), as V4's runner names its staging pool's."""
        return self.pool_plan.blocks[KV]

    @torch.inference_mode()
    def execute(self, steps: list[SeqStep], on_kv_written: Callable[[int], None] | None = None
                ) -> torch.Tensor | SpecOutput:
        """Run one step over ``steps`` (any mix of prefill chunks and decode tokens).

        Writes the KV of every computed token into the cache at its slot (under CP: every
        rank's cache gets every token of the step, each rank having computed its
        ``cp_token_slices`` of each chunk). ``on_kv_written(layer)``: called right after
        each layer's KV write (``AttentionMetadata.on_kv_written``); a step with it runs
        eager.

        Returns:
            ``[B, vocab]`` fp32 logits at the last token of each step, in ``steps`` order;
            with speculative decoding on, a :class:`SpecOutput` instead.

        Raises:
            ValueError: an empty step list or step, a block table too short or naming
                blocks outside the cache, or a request longer than max_position_embeddings.
        """
        if not steps:
            raise ValueError("execute() needs at least one SeqStep")
        for s in steps:
            self._check_step(s)
        if self.spec is not None:
            return self.spec.run(steps, on_kv_written)
        logits = None if on_kv_written is not None else self._captured(steps)
        return logits if logits is not None else self._forward(steps, on_kv_written)

    def _captured(self, steps: list[SeqStep]) -> torch.Tensor | None:
        """The compiled forward's output: ``[B, vocab]`` logits of a prefill-only step
        (prefill graph mode) or of a decode-only step of one-token rows (speculative:
        ``[B, hidden]`` normed hidden states), or None when the step runs eager (graph modes
        off, no bucket fits, or the capture failed)."""
        if self.graphs is None and self.prefill_graph is None:  # NOTE: eager: no per-step lists
            return None
        query_lens = [len(s.token_ids) for s in steps]
        context_lens = [s.num_computed_tokens for s in steps]
        if self.prefill_graph is not None and PrefillGraph.takes(query_lens, context_lens):
            return self._run_prefill_graph(steps)
        if self.graphs is None:
            return None
        bucket = self.graphs.bucket_for(query_lens, context_lens)
        return None if bucket is None else self._run_graph(steps, bucket)

    def graph_modes(self) -> tuple[tuple[str, str], ...]:
        """(forward, state) of each compiled forward: "decode" (speculative: "verify" and
        "draft") and "prefill", each as its ``describe()``; () with graph modes off."""
        graphs = [g for g in (self.graphs, self.spec and self.spec.draft_graphs) if g]
        modes = [(g.name, g.describe()) for g in graphs]
        if self.prefill_graph is not None:
            modes.append(("prefill", self.prefill_graph.describe()))
        return tuple(modes)

    @torch.inference_mode()
    def warmup_prefill_graph(self) -> None:
        """Compile the prefill graph now, on a two-token prefill written to the scratch
        block; no-op with prefill graph mode off.

        Raises:
            engine.graph.GraphCaptureError: the capture failed with ``required``.
        """
        if self.prefill_graph is not None:
            warm = SeqStep("<graph-padding>", (0, 0), 0, (self.kv_cache.scratch_block,))
            self._run_prefill_graph([warm], padding=True)

    def _run_prefill_graph(self, steps: list[SeqStep], padding: bool = False
                           ) -> torch.Tensor | None:
        """:meth:`PrefillGraph.step` of ``steps`` (``padding``: the warm-up's, whose table
        is the scratch block)."""
        return self.prefill_graph.step(*self._inputs(steps, num_real=0 if padding else None))

    @torch.inference_mode()
    def warmup_graphs(self) -> None:
        """Capture every graph bucket now (a step of padding rows only, written to the
        scratch block; speculative: the verify and the draft forwards) and log which run
        eager (one line per captured forward). No-op with graph mode off.

        Raises:
            engine.graph.GraphCaptureError: a bucket failed with ``graph.required``.
        """
        if self.graphs is None:
            return
        # NOTE: a context over two blocks: with the padding step's one-block table the capture
        # specializes on that width (size 1) and the first real step compiles again
        warm = self._padding_step(context=self.kv_spec.block_size + 1)
        for bucket in self.graphs.config.batch_sizes:
            self._run_graph([], bucket, padding=warm)
        captured = [self.graphs]
        if self.spec is not None:
            captured.append(self.spec.warmup_graphs(warm))
        for graphs in captured:  # NOTE: one line each at start-up, never a silent fallback
            status = graphs.status()
            if status["eager"]:
                log.error("graph mode: %s buckets %s captured; buckets %s run EAGER (capture "
                          "failed: %s)", graphs.name, status["captured"], sorted(status["eager"]),
                          "; ".join(f"{b}: {why}" for b, why in status["eager"].items()))
            else:
                log.info("graph mode: every %s bucket captured: %s", graphs.name,
                         status["captured"])

    def _run_graph(self, steps: list[SeqStep], bucket: int,
                   padding: SeqStep | None = None) -> torch.Tensor | None:
        """``[len(steps), vocab]`` logits of a decode-only step from the captured forward of
        ``bucket`` (steps padded to ``bucket`` rows with ``padding``, default
        :meth:`_padding_step`), or None when that bucket runs eager."""
        padded = steps + [padding or self._padding_step()] * (bucket - len(steps))
        input_ids, meta = self._inputs(padded, num_real=len(steps))
        mark_context_dynamic(meta.decode)
        out = self.graphs.run(bucket, input_ids, meta, self.kv_cache, self.spec is not None)
        return None if out is None else out[:len(steps)]

    def _padding_step(self, context: int = 1) -> SeqStep:
        """A dummy decode sequence (one token after ``context`` cached ones) whose table is
        the scratch block only: its KV lands there, never in a block the pool hands out."""
        blocks = -(-(context + 1) // self.kv_spec.block_size)
        return SeqStep("<graph-padding>", (0,), context,
                       (self.kv_cache.scratch_block,) * blocks)

    def _forward(self, steps: list[SeqStep],
                 on_kv_written: Callable[[int], None] | None = None) -> torch.Tensor:
        """The eager forward of ``steps`` (checked): ``[B, vocab]`` fp32 logits."""
        input_ids, meta = self._inputs(steps)
        if on_kv_written is not None:
            meta = replace(meta, on_kv_written=on_kv_written)
        return self.model(input_ids, meta, self.kv_cache)

    def _inputs(self, steps: list[SeqStep], num_real: int | None = None
                ) -> tuple[torch.Tensor, AttentionMetadata]:
        """The model inputs of ``steps``: ``[T]`` int64 token ids (this CP rank's rows under
        CP) and the step's attention metadata. ``num_real``: steps after the first
        ``num_real`` are graph padding rows (their tables are not cached or checked). A
        decode-only step without padding rows reuses the previous one's metadata
        (:mod:`engine.decode_step_cache`)."""
        real = steps[:num_real]  # NOTE: graph padding rows (after them) use the scratch block
        ids = [s.request_id for s in real]
        tables = [*self._block_tables.tensors(ids, [s.block_ids for s in real]),
                  *(s.block_ids for s in steps[len(real):])]
        if len(real) == len(steps) and self.cp.size == 1 and all(
                len(s.token_ids) == 1 and s.num_computed_tokens > 0 for s in steps):
            meta = self._decode_cache.build(ids, [s.num_computed_tokens for s in steps],
                                            [s.block_ids for s in steps])
        else:
            self._decode_cache.reset()
            meta = build_attention_metadata(
                [len(s.token_ids) for s in steps], [s.num_computed_tokens for s in steps],
                tables, self.kv_spec.block_size, self.device, prefill_only=self.cp.size > 1)
        input_ids = torch.tensor([t for s in steps for t in s.token_ids], dtype=torch.int64,
                                 device=self.device)
        if self.cp.size > 1:
            meta = meta.with_cp(build_cp_step(meta.prefills, self.cp, self.device))
            input_ids = input_ids[meta.cp.local_rows]
        return input_ids, meta

    @torch.inference_mode()
    def execute_empty(self) -> None:
        """A zero-token step: only this rank's part of the EP collectives (every MoE layer's
        dispatch and combine, with nothing to send), so that the other ranks' step can
        complete. A DP rank with no work in a lockstep step calls this; no-op without EP.
        Touches no KV cache."""
        if self.ep.size > 1 and self.spec is not None:
            self.spec.run_empty()
        elif self.ep.size > 1:
            self.model.forward_empty()

    def _check_step(self, s: SeqStep) -> None:
        limit = self.model_config.max_position_embeddings
        if s.num_computed_tokens + len(s.token_ids) + s.num_drafts > limit:
            raise ValueError(
                f"request {s.request_id} reaches {s.num_computed_tokens + len(s.token_ids)} "
                f"tokens; the model's max_position_embeddings is {limit}: shorten the prompt "
                "or max_tokens")


def build_runner(checkpoint_dir: str | Path, *, prefix_cache: bool = False,
                 staging_blocks: int = 0, v4_shape: tuple[int, int, int] | None = None,
                 **kwargs) -> ModelRunner | V4Runner:
    """The runner of ``checkpoint_dir``'s architecture: :class:`engine.v4.runner.V4Runner` for
    DeepSeek-V4 (its serving layout checked; ``prefix_cache``: the scheduler pool caches
    prefixes, which V4 does not support; ``staging_blocks``: its PD staging cache's blocks,
    0: ``num_kv_blocks``; ``v4_shape``: ``(max_num_seqs, max_model_len, step_tokens)`` its
    group pools are sized for, :class:`engine.pool_plan.RequestShape`, None: every group
    ``num_kv_blocks`` blocks), else :class:`ModelRunner` (``kwargs`` as its).

    Raises:
        ValueError: a layout V4 does not support (the message lists each and its fix).
    """
    from engine.v4.runner import V4Runner, is_v4_checkpoint  # noqa: PLC0415

    if not is_v4_checkpoint(checkpoint_dir):
        return ModelRunner(checkpoint_dir, **kwargs)
    prefill_graph = kwargs.get("prefill_graph")
    if prefill_graph is not None and prefill_graph.enabled:
        raise ValueError("prefill graph mode does not run DeepSeek-V4 checkpoints (its own "
                         "runner, engine/v4/runner.py): set prefill.graph.enabled false")
    graph = kwargs.get("graph")
    return V4Runner(checkpoint_dir, num_kv_blocks=kwargs["num_kv_blocks"],
                    block_size=kwargs["block_size"], dtype=kwargs.get("dtype", torch.float32),
                    device=kwargs.get("device") or "cpu", tp=kwargs.get("tp"),
                    ep=kwargs.get("ep"), cp=_size(kwargs.get("cp")),
                    graph=graph is not None and graph.enabled,
                    num_speculative_tokens=kwargs.get("num_speculative_tokens", 0),
                    layer_sharding=tuple(kwargs.get("layer_sharding", ())),
                    prefix_cache=prefix_cache, staging_blocks=staging_blocks,
                    shape=None if v4_shape is None else RequestShape(*v4_shape),
                    fp8_storage=kwargs.get("fp8_storage", "dequantize"))


def _size(group: TPGroup | EPGroup | CPGroup | None) -> int:
    return 1 if group is None else group.size


def _check_cp(tp: TPGroup, cp: CPGroup, graph: GraphConfig) -> None:
    """Raise ValueError, naming the fix, for a layout context parallel does not support."""
    if cp.size > 1 and graph.enabled:
        raise ValueError(f"graph mode with cp={cp.size}: context parallel is prefill-only and "
                         "graph mode captures decode steps; turn graph mode off")
    if cp.size > 1 and tp.size > 1:
        raise ValueError(f"cp={cp.size} with tp={tp.size}: a context-parallel prefill "
                         "instance runs tp=1 (its ranks are the CP group); set tp to 1")


def _check_spec(config: ModelConfig, k: int) -> None:
    """Raise ValueError, naming the fix, when speculative decoding with ``k`` drafts cannot
    run on ``config`` here."""
    if k <= 0:
        return
    if config.num_nextn_predict_layers < 1:
        raise ValueError("speculative decoding (method mtp) needs a checkpoint with an MTP "
                         "module (config.json num_nextn_predict_layers >= 1, weights under "
                         f"model.layers.{config.num_hidden_layers}.*); this one has none: "
                         "remove decode.speculative or use a checkpoint that ships MTP")


def _fixed_ep_dispatch(model: torch.nn.Module, capacity: int) -> None:
    """Graph mode under EP: every MoE layer dispatches by the capture-safe fixed-capacity
    all-to-all (:func:`engine.expert_parallel.ep_routed_fixed`) of ``capacity`` tokens per
    rank, in captured and eager steps alike (all EP ranks must run the same collectives)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.ep_capacity = capacity
