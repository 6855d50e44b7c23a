"""Control-plane messages between the router and the worker leaders (Ray actor calls, or the
leader's call socket with `router.leader_calls: socket`: rank/call_server.py).

One schema module for the control plane: the router converts protobuf to these dataclasses at
its edge (orchestrator/api/convert.py) and the workers never see protobuf. The data plane (KV
bytes between ranks) has its own msgpack schema in ``kv_transfer``.

The router sends a leader one :data:`LeaderRequest` per call (``Rank.request``, handled by the
rank's role): a decode leader takes :class:`Reserve` (answers :class:`Reservation` or
:class:`Rejection`) and :class:`Admit`; a prefill leader :class:`Prefill`; a colocated leader
:class:`Generate`; every leader :class:`Abort` (answers whether the request was there; on
prefill only once no KV send into its reservation is in flight, so decode may free its
blocks). Events come back over each leader's token stream (``Rank.open_events(subscriber)``,
rank/event_stream.py; ``Rank.poll`` while no router subscribed), and
``Rank.status() -> InstanceStatusInfo`` is the snapshot.

A leader whose instance lost a rank (dead or hung) is out of service: ``Reserve``, ``Admit``,
``Prefill`` and ``Generate`` raise :class:`InstanceOutOfService` (through Ray: a
``RayTaskError`` that is also an instance of it), and ``status().broken`` says why.

This module imports neither torch nor Ray: the gRPC client (orchestrator/api/client.py) uses it.
What the rank actors are built from is in rank/config.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv_events import KVCacheEvents
from engine.sampling_params import TokenLogprobs
from kv_transfer import KVPeer
from rank.step_timing import StepTimings

if TYPE_CHECKING:  # NOTE: engine.request imports torch (the client must not)
    from engine.request import RequestSpec


class InstanceOutOfService(RuntimeError):
    """A leader refuses new work: a rank of its instance is dead or hung. The message names
    the instance and the rank; orch replaces the instance, so the caller tries another one."""


@dataclass(frozen=True)
class Reservation:
    """KV blocks a decode instance set aside for one request, before prefill computes.

    Attributes:
        request_id: the request.
        decode_instance: name of the decode instance holding the blocks.
        block_ids: the request's block table on the decode side (covers
            ``RequestSpec.max_total_tokens`` tokens).
        block_size: tokens per block on the decode side.
        peers: one :class:`~kv_transfer.KVPeer` per decode rank, in rank order.
        num_cached_tokens: leading prompt tokens whose KV the decode side already holds
            (prefix cache, a multiple of ``block_size``): prefill ships only tokens
            ``[num_cached_tokens, prompt)``.
    """

    request_id: str
    decode_instance: str
    block_ids: tuple[int, ...]
    block_size: int
    peers: tuple[KVPeer, ...]
    num_cached_tokens: int = 0

    @property
    def decode_tp(self) -> int:
        return len(self.peers)


@dataclass(frozen=True)
class Rejection:
    """Why a decode instance could not reserve now.

    Attributes:
        request_id: the request.
        reason: human-readable cause with what to do.
        retryable: True when the instance is only full for now (back-pressure), False when the
            request can never fit (it needs more blocks than the instance has).
        blocks_needed: with ``retryable``, the KV blocks the request needs there (the
            router's admission queue waits until the instance reports that many free).
        group_blocks_needed: with ``retryable`` on DeepSeek-V4, ``(group, blocks)`` the request
            commits in each KV group pool (:meth:`engine.scheduler.Scheduler.admission_need`;
            the queue also waits until the instance reports that many uncommitted); empty
            otherwise.
    """

    request_id: str
    reason: str
    retryable: bool = True
    blocks_needed: int = 0
    group_blocks_needed: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Reserve:
    """Decode leader: take blocks for ``spec``'s prompt + max_tokens before prefill computes,
    and arm every decode rank's KV receiver for a prefill instance of ``prefill_cp`` x
    ``prefill_tp`` ranks (the transfer plan's sizes). Answer: :class:`Reservation` or
    :class:`Rejection`."""

    spec: RequestSpec
    prefill_tp: int = 1
    prefill_cp: int = 1


@dataclass(frozen=True)
class Prefill:
    """Prefill leader: run ``spec``'s prompt in chunks, its KV sent into ``reservation``; the
    first token comes back as a ``TokenEvent``. ``reservation`` None: computed while decode
    reserves (the router's eager launch); its KV waits for :class:`Attach`."""

    spec: RequestSpec
    reservation: Reservation | None


@dataclass(frozen=True)
class Attach:
    """Prefill leader: the decode reservation of a request launched without one; the KV
    computed so far ships now, the rest chunk by chunk. Answer: False when the request is
    gone (aborted, failed or expired: its end event says which)."""

    request_id: str
    reservation: Reservation


@dataclass(frozen=True)
class Admit:
    """Decode leader: prefill's first token of a reserved request; it joins the batch once its
    KV is complete. Returns at once (never waits for a step in progress)."""

    request_id: str
    first_token_id: int


@dataclass(frozen=True)
class Generate:
    """Colocated leader: queue ``spec``; its tokens come back as ``TokenEvent``s."""

    spec: RequestSpec


@dataclass(frozen=True)
class Abort:
    """Any leader: drop the request wherever it is and free its blocks; answers whether it
    was there (an abort that finds nothing keeps a late call of the same id from starting)."""

    request_id: str


LeaderRequest = Reserve | Prefill | Attach | Admit | Generate | Abort


@dataclass(frozen=True)
class TokenEvent:
    """New tokens (and/or the end) of one request, from a worker leader to the router.

    Attributes:
        request_id: the request.
        token_ids: tokens generated since the previous event (may be empty on finish).
        finish_reason: None while running; "stop", "length", "abort" or "error" at the end.
        error: message when ``finish_reason == "error"``.
        source: "prefill" (the first token), "decode" or "colocated".
        instance: name of the instance that produced it.
        retryable: with ``finish_reason == "error"``: True when the instance failed (dead,
            unreachable, broken), not the request; the router may run the request again
            elsewhere if no token was streamed yet. False: the request's own fault, final.
        num_cached_tokens: on the event of a request's first token (prefill or colocated):
            prompt tokens the instance found in its prefix cache (not computed).
        kv_events: the instance's prefix-cache changes since its previous batch
            (:class:`engine.kv_events.KVCacheEvents`); an event that carries them has an empty
            ``request_id`` and belongs to no request.
        logprobs: with ``sampling.logprobs`` set, one entry per token of ``token_ids``.
        ttft_phases: on the event of a request's first token (prefill or colocated): where
            its time went on the leader, (phase, seconds) in order
            (:class:`rank.step_timing.FirstTokenClock`); () otherwise.
    """

    request_id: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    source: str = "decode"
    instance: str = ""
    retryable: bool = False
    num_cached_tokens: int = 0
    kv_events: KVCacheEvents | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    ttft_phases: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class TransferRecord:
    """One request's KV on one (prefill rank, decode rank) pair, as a prefill rank closed it.

    Attributes:
        pair: "prefill-0:1->decode-0:0" (instance:rank on each side).
        nbytes: K + V payload bytes this rank queued for the request on the pair.
        seconds: first chunk queued -> every send of the request idle on this rank.
        ok: no failure reported for the request.
    """

    pair: str
    nbytes: int
    seconds: float
    ok: bool


@dataclass(frozen=True)
class KVTailStats:
    """``kv_tail_s`` of the requests a decode instance took into its batch since it started:
    seconds from the end of the prefill forward that computed a request's last chunk to the
    moment every decode rank held every (layer, token) cell of its prompt (the KV still in
    flight after the forward; docs/kv_transfer.md "Layer by layer"). Requests whose prefill
    side did not say when its forward ended are not counted.

    Attributes:
        count: requests measured. sum_s: their tails summed. max_s: the longest.
        last_s: the newest one's.
    """

    count: int = 0
    sum_s: float = 0.0
    max_s: float = 0.0
    last_s: float = 0.0

    def add(self, tail_s: float) -> KVTailStats:
        """These stats with one more request's tail (seconds)."""
        return KVTailStats(self.count + 1, self.sum_s + tail_s, max(self.max_s, tail_s),
                           tail_s)

    def mean_since(self, before: KVTailStats) -> float | None:
        """Mean tail (seconds) of the requests measured after ``before``; None for none."""
        n = self.count - before.count
        return (self.sum_s - before.sum_s) / n if n > 0 else None


@dataclass(frozen=True)
class InstanceStatusInfo:
    """Snapshot of one instance for ``orch status`` and metrics.

    ``broken`` is None while the instance serves; else why it is out of service (e.g. "rank 1
    is gone (ActorDiedError)"): every request it had ended with an error and new work is
    refused until orch replaces it.
    """

    name: str
    role: str
    tp: int
    # (rank, Ray node id, device, process id) per rank
    ranks: tuple[tuple[int, str, str, int], ...] = field(default_factory=tuple)
    queue_depth: int = 0
    running: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    outstanding_tokens: int = 0
    kv_bytes_sent: int = 0
    kv_failures: int = 0
    # Per-pair KV transfer records closed since the previous status call (prefill).
    transfers: tuple[TransferRecord, ...] = ()
    broken: str | None = None
    # Where the leader's step time goes (rank/step_timing.py).
    step_timings: StepTimings = StepTimings()
    # Prefix cache: blocks findable by hash now; prompt tokens looked up / found cached since
    # the instance started (hit rate = hit / queried).
    cached_blocks: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    # KV still in flight after the prefill forward (decode).
    kv_tail: KVTailStats = KVTailStats()
    # MTP speculative decoding since start: drafts kept / drafts made, and tokens emitted per
    # verify step (1 + kept drafts); both 0 without drafts (rank/spec_verify.py).
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    # DeepSeek-V4: (group, free blocks, total blocks) of each KV group's own pool
    # (engine/pool_plan.py: "window", "entries/<kind>" holding a compressed kind's entries
    # and, CSA, its index keys, "state/<kind>" one block per request); () for other models,
    # whose one pool is free_blocks / total_blocks. An ended request's V4 blocks count as
    # held until the leader applies its release: its next step, or its loop's next idle
    # iteration (engine/v4/request_caches.py).
    kv_groups: tuple[tuple[str, int, int], ...] = ()
    # Graph modes of the leader's runner: (forward, state) per compiled forward, e.g.
    # ("decode", "captured [1, 2, 4]"), ("prefill", "eager (RuntimeError: ...)");
    # () with graph modes off (engine.runner.ModelRunner.graph_modes).
    graph_modes: tuple[tuple[str, str], ...] = ()

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens found cached / looked up (0 before any lookup)."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens \
            if self.prefix_queried_tokens else 0.0
