"""One role's parallel layout and scheduler sizes: what a rank's memory plan depends on.

:class:`RoleLayout` is the input of every row of the memory plan (:mod:`.memory_plan`);
:func:`rank_layout` is the engine's own layout of one rank under it (engine/layout.py
:func:`engine.layout.tp_layout`), so the plan splits weights by the engine's rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.layout import TPLayout, tp_layout
from engine.model_config import ModelConfig


@dataclass(frozen=True)
class RoleLayout:
    """One role's parallel layout and scheduler sizes (what the plan depends on).

    Attributes:
        role: "prefill", "decode" or "colocated".
        dp, tp: DP ranks of the role and TP ranks per DP rank.
        cp: context-parallel ranks per DP rank (prefill; tp is 1 then).
        layer_sharding: attention linears stored on one CP rank per layer (cp > 1).
        ep: routed experts split over all ``dp * tp`` ranks (else TP-sharded per DP rank).
        num_kv_blocks, block_size: the KV cache of one DP rank (every TP rank holds all of it).
        step_tokens: most tokens one step runs (prefill: max_num_batched_tokens; decode:
            max_num_seqs).
        max_num_seqs: most sequences one step samples (logits rows).
        max_model_len: longest sequence, tokens (the prefix chunked prefill decompresses).
        pair_groups: KV pair groups one rank of the role is in (0: colocated).
        pair_buffer_bytes: device memory one pair group holds (kv_transfer/backend.py
            ``COMM_SETTINGS``).
        comm_buffer_bytes: device memory one TP / EP / CP communicator holds (the backend's
            default there, or ``kv_transfer.comm_buffer_mb``).
        mtp: the ranks hold the checkpoint's MTP module and its KV cache (speculative
            decoding, ``decode.speculative``).
        staging_blocks: blocks of a DeepSeek-V4 PD rank's staging cache (its role's
            ``v4_staging_blocks``, else ``num_kv_blocks``; engine/v4/staging.py); 0 for
            colocated roles. Other models ignore it.
        chunk_size: most tokens one request writes per step (the scheduler's: prefill chunk,
            1 on decode): a DeepSeek-V4 window's span per request (engine/pool_plan.py).
            Other models ignore it.
    """

    role: str
    dp: int
    tp: int
    ep: bool
    num_kv_blocks: int
    block_size: int
    step_tokens: int
    max_num_seqs: int
    max_model_len: int
    cp: int = 1
    layer_sharding: tuple[str, ...] = ()
    pair_groups: int = 0
    pair_buffer_bytes: int = 0
    comm_buffer_bytes: int = 0
    mtp: bool = False
    staging_blocks: int = 0
    chunk_size: int = 1

    @property
    def collectives(self) -> tuple[str, ...]:
        """The rank's TP, EP and CP communicators (each when it spans more than one rank)."""
        return tuple(name for name, on in (("TP", self.tp > 1), ("EP", self.ep_size > 1),
                                           ("CP", self.cp > 1)) if on)

    @property
    def ranks(self) -> int:
        """Ranks of the role: ``dp * tp * cp``."""
        return self.dp * self.tp * self.cp

    @property
    def section(self) -> str:
        """The config section that sizes the role (colocated instances: ``decode``)."""
        return "decode" if self.role == "colocated" else self.role

    @property
    def ep_size(self) -> int:
        """Ranks the routed experts are split over (1: every DP rank holds all experts)."""
        return self.ranks if self.ep else 1


def rank_layout(m: ModelConfig, lay: RoleLayout) -> TPLayout:
    """The engine's layout of one rank of the role (EP rank 0: every EP rank holds as many).

    Raises:
        ValueError: ``lay`` is not one the engine can build (:func:`engine.layout.tp_layout`).
    """
    return tp_layout(m, lay.tp, lay.ep_size)
