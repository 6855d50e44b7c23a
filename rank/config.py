"""What the rank actors of one instance are built from: one frozen config per component.

The orchestrator derives one :class:`InstanceConfig` per instance from the YAML file
(``orchestrator.config.schema.OrchConfig.instances``); every rank of the instance receives it. Each
part holds only what its component reads, filled from the YAML section of the instance's role:

- :class:`SchedulerConfig`: the leader's scheduler and block pool, and the KV cache size.
- :class:`ParallelConfig`: TP size, device, collective backend, rendezvous address.
- ``kv_transfer.TransferConfig``: the bounded waits of the KV transfer layer (declared there
  once; the YAML ``kv_transfer`` section produces it).
- ``engine.graph.GraphConfig``: graph mode of the decode forward (decode and colocated
  instances; the YAML ``decode.graph`` section).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.graph import GraphConfig
from engine.prefill_graph import PrefillGraphConfig
from engine.prefix_hash import cache_salt
from kv_transfer.config import TransferConfig


@dataclass(frozen=True)
class SchedulerConfig:
    """The leader's scheduler and block pool (and every rank's KV cache size).

    Attributes:
        block_size: tokens per KV block.
        num_kv_blocks: KV blocks per rank.
        chunk_size: most tokens of one request computed in one step (chunked prefill; 1 on
            decode, which computes one token per running request).
        max_num_batched_tokens: most tokens computed in one step across requests.
        max_num_seqs: most requests running at once.
        prefix_cache: keep full KV blocks findable by their tokens' hash and reuse them
            (engine/block_pool.py); off: every prompt is computed from its first token.
        num_speculative_tokens: MTP drafts per decoding request per step (0: speculative
            decoding off); every role of a speculative deployment builds the MTP module
            (prefill runs it over prompts, engine/spec_forward.py).
        staging_blocks: DeepSeek-V4 PD roles only: blocks of the scheduler pool, which there
            carries only the requests' staging rows, and of the staging cache the KV transfer
            reads / writes (engine/v4/staging.py); 0: ``num_kv_blocks``.
        max_model_len: tokens of the longest request (``model.max_model_len``): a DeepSeek-V4
            rank sizes its KV group pools for ``max_num_seqs`` such requests written
            ``chunk_size`` tokens a step (engine/pool_plan.py); 0: not given, every V4
            group gets ``num_kv_blocks`` blocks.

    Raises:
        ValueError: a size < 1, or ``chunk_size > max_num_batched_tokens``.
    """

    block_size: int
    num_kv_blocks: int
    chunk_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    prefix_cache: bool = True
    num_speculative_tokens: int = 0
    staging_blocks: int = 0
    max_model_len: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "chunk_size", "max_num_batched_tokens",
                     "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.max_model_len < 0:
            raise ValueError(f"SchedulerConfig.max_model_len must be >= 0 (0: not given), got "
                             f"{self.max_model_len}")
        if self.staging_blocks < 0:
            raise ValueError(f"SchedulerConfig.staging_blocks must be >= 0 (0: num_kv_blocks), "
                             f"got {self.staging_blocks}")
        if self.chunk_size > self.max_num_batched_tokens:
            raise ValueError(f"SchedulerConfig.chunk_size ({self.chunk_size}) must be <= "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens})")

    @property
    def v4_shape(self) -> tuple[int, int, int] | None:
        """``(max_num_seqs, max_model_len, chunk_size)``: the requests a DeepSeek-V4 rank's
        group pools are sized for (engine/pool_plan.py ``RequestShape``); None without
        ``max_model_len``."""
        return (self.max_num_seqs, self.max_model_len, self.chunk_size) \
            if self.max_model_len else None


@dataclass(frozen=True)
class ParallelConfig:
    """Where and how the instance's ranks run together.

    Attributes:
        tp: tensor-parallel size (ranks in the instance without ``cp``).
        cp: context-parallel size (prefill only): one prompt's tokens split over ``cp`` ranks
            with all heads each (tp is 1 then); the instance has ``ranks = tp * cp`` ranks.
        layer_sharding: with ``cp > 1``, attention weights (q_b_proj, o_proj, ...) each layer
            stores on one rank only and broadcasts ahead of use (``engine.parallel``).
        dp: instances of the role (DP ranks); dp_rank: this instance's index, ``0 <= dp_rank
            < dp`` (instance ``{role}-{dp_rank}``).
        ep: expert parallelism: the routed experts are split over all ``dp * ranks`` ranks of
            the role (EP rank ``dp_rank * ranks + rank``; ranks = tp, or cp for a CP prefill)
            and the role's DP ranks step in lockstep (rank/dp_sync.py). Off:
            instances are independent replicas.
        device: "cpu", "cuda" or "npu" (decided once by the orchestrator, engine.platform).
        dist_backend: "gloo", "nccl" or "hccl" (TP groups and KV pair groups).
        bind_host: address the rank's stores listen on (127.0.0.1 on one machine; empty: the
            node's IP as Ray reports it, for multi-node clusters).
        step_timeout_s: bound on one SPMD step across the instance's ranks (seconds).
    """

    tp: int = 1
    cp: int = 1
    layer_sharding: tuple[str, ...] = ()
    dp: int = 1
    dp_rank: int = 0
    ep: bool = False
    device: str = "cpu"
    dist_backend: str = "gloo"
    bind_host: str = "127.0.0.1"
    step_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.dp:
            raise ValueError(f"ParallelConfig.dp_rank ({self.dp_rank}) must be in [0, dp="
                             f"{self.dp})")
        if self.ep and self.dp * self.ranks < 2:
            raise ValueError("ParallelConfig.ep needs dp * tp * cp >= 2 ranks in the role")
        if self.cp > 1 and self.tp != 1:
            raise ValueError(f"ParallelConfig.cp ({self.cp}) > 1 needs tp == 1, got {self.tp}")
        if self.layer_sharding and self.cp == 1:
            raise ValueError("ParallelConfig.layer_sharding needs cp > 1")

    @property
    def ranks(self) -> int:
        """Ranks (actors) of one instance: ``tp * cp``."""
        return self.tp * self.cp

    @property
    def ep_size(self) -> int:
        """Ranks of the role's expert-parallel group (``dp * ranks``; 1 when ep is off)."""
        return self.dp * self.ranks if self.ep else 1

    def ep_rank(self, rank: int) -> int:
        """EP rank of rank ``rank`` (TP or CP) of this instance (0 when ep is off)."""
        return self.dp_rank * self.ranks + rank if self.ep else 0


@dataclass(frozen=True)
class InstanceConfig:
    """What every rank actor of one instance is built from (made by the orchestrator's config).

    Attributes:
        name: instance name, e.g. "prefill-0", "decode-1", "colocated-0".
        role: "prefill", "decode" or "colocated".
        checkpoint_dir: HF checkpoint directory (config.json, *.safetensors, tokenizer.json).
        scheduler: scheduler, block pool and KV cache sizes of this role.
        dtype: "float32", "bfloat16" or "float16".
        fp8_storage: FP8 checkpoints: "dequantize" at load or keep "fp8" (docs/quantization.md).
        parallel: TP size, device, backend, bind address.
        transfer: KV transfer bounds (seconds).
        graph: graph mode of the decode forward (off on prefill instances).
        prefill_graph: graph mode of prefill-only steps (off on decode instances).
    """

    name: str
    role: str
    checkpoint_dir: str
    scheduler: SchedulerConfig
    dtype: str = "float32"
    fp8_storage: str = "dequantize"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    prefill_graph: PrefillGraphConfig = field(default_factory=PrefillGraphConfig)

    @property
    def cache_salt(self) -> int | None:
        """The prefix cache's hash root for this instance's KV (what changes the KV of the
        same tokens: checkpoint, dtype, weight storage), or None with the cache off."""
        if not self.scheduler.prefix_cache:
            return None
        return cache_salt(self.checkpoint_dir, self.dtype, self.fp8_storage)
