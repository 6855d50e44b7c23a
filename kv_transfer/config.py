"""Configuration of the KV transfer layer (one frozen dataclass, validated when built)."""

from __future__ import annotations

from dataclasses import dataclass

SAME_NODE = ("auto", "off")  # values of TransferConfig.same_node


@dataclass(frozen=True)
class TransferConfig:
    """Bounded waits of the KV transfer layer, in seconds.

    Attributes:
        connect_timeout_s: rendezvous with the decode rank's TCPStore and building the 2-rank
            process group of a pair (both sides).
        header_timeout_s: decode side, only the bound on joining a receiver thread at
            ``close()`` (``header_timeout_s + payload_timeout_s``); it bounds nothing else:
            the header travels in the doorbell itself, and an idle receiver waits for the
            doorbell without a bound.
        payload_timeout_s: receiving one payload message (a (buffer, layer) view or a pack:
            :mod:`~kv_transfer.packs`; on a same-node pair a pack's "ready"); sending one (a
            send also waits for the peer to finish the record before it), or waiting for a
            same-node slot's ack.
        completion_timeout_s: decode side, from ``expect()`` until every planned layer and
            every ``done`` record arrived; prefill side, the default bound of ``wait``.
        poll_interval_s: how often the decode rank's acceptor looks for new pair
            announcements (pair set-up latency); idle sender threads check their stop flag
            every ten intervals. Receivers do not poll (they block on the doorbell).
        heartbeat_s: a sender thread posts a heartbeat on its pair this often (also while
            idle); a receiver waiting for a doorbell looks at the heartbeats this often.
        peer_timeout_s: decode side: a pair whose prefill rank posted neither a doorbell nor
            a heartbeat for this long is lost (the rank died or hangs): the requests it
            carried fail at once instead of at their completion deadline.
        retry_backoff_s: prefill side: after a failed connect, records to that decode
            address fail at once for this long, doubling per failure up to
            ``connect_timeout_s``; a new address (restarted rank) is tried at once.
        same_node: ``auto``: a pair whose two ranks run on one node moves bytes through a
            shared segment (:mod:`~kv_transfer.local`; cpu caches: ``/dev/shm``) instead of
            its process group; ``off``: always the process group.
        layerwise: prefill side: each layer's KV of a chunk is queued right after the
            layer's cache write, while the next layers compute (docs/kv_transfer.md
            "Layer by layer"); False: a chunk's layers are queued after its whole forward
            (the baseline the layer-by-layer figures are measured against).
    """

    connect_timeout_s: float = 30.0
    header_timeout_s: float = 30.0
    payload_timeout_s: float = 60.0
    completion_timeout_s: float = 120.0
    poll_interval_s: float = 0.02
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 10.0
    retry_backoff_s: float = 1.0
    same_node: str = "auto"
    layerwise: bool = True

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "header_timeout_s", "payload_timeout_s",
                     "completion_timeout_s", "poll_interval_s", "heartbeat_s",
                     "peer_timeout_s", "retry_backoff_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"TransferConfig.{name} must be > 0 seconds, got {value}")
        if self.same_node not in SAME_NODE:
            raise ValueError(f"TransferConfig.same_node must be one of {SAME_NODE}, got "
                             f"{self.same_node!r}")
        if self.peer_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError(f"TransferConfig.peer_timeout_s ({self.peer_timeout_s}) must be "
                             f"> 2 x heartbeat_s ({self.heartbeat_s}): raise it, or lower "
                             "heartbeat_s")
