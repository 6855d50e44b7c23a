"""Decode rank side of the KV transfer: what the decode worker calls, per rank.

Call order per request: ``expect`` on every decode rank BEFORE the prefill instance is told to
start (records of unknown requests are read and dropped), then ``poll`` until SUCCESS or
FAILED (:class:`~kv_transfer.status.KVPoll`); finally ``release`` (after success, abort or
failure). Once ``release`` returns no byte is written into the request's slots any more, so
its blocks may be freed.

The prefill tp and cp needed for the plan come with ``expect`` (the router knows both instances).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kv_transfer import local, packs, wire
from kv_transfer.backend import backend_for
from kv_transfer.config import TransferConfig
from kv_transfer.errors import LayoutMismatchError
from kv_transfer.layout import KVLayout
from kv_transfer.pair import Rendezvous
from kv_transfer.payload import PayloadStats, cache_slots, check_cache
from kv_transfer.receiver import ReceiverChannel
from kv_transfer.status import KVStatus
from kv_transfer.tracker import RequestTracker

log = logging.getLogger(__name__)


class DecodeKVConnector:
    """KV receiver of one decode rank: hosts the pair rendezvous, runs receiver threads.

    Args:
        kv_cache: the rank's ``KVCache`` (or any object whose ``layer_buffers(layer)`` gives
            the buffers ``layout`` names, see :mod:`~kv_transfer.payload`).
        layout: this instance's :class:`KVLayout`.
        instance, rank: this rank's identity.
        config: bounded waits.
        host: address to bind the rendezvous store on and to publish (127.0.0.1 locally).

    Raises:
        ValueError: ``kv_cache`` does not hold the buffers ``layout`` names.
    """

    def __init__(self, kv_cache: object, layout: KVLayout, instance: str, rank: int,
                 config: TransferConfig, host: str = "127.0.0.1") -> None:
        check_cache(kv_cache, layout, layout.heads_of(rank))
        self._cache, self._layout, self._config = kv_cache, layout, config
        self._instance, self._rank, self._host = instance, rank, host
        self._me = f"{instance}/{rank}"
        self._device = cache_slots(kv_cache)[1]
        self._backend = backend_for(self._device)
        self._local = local.local_backend(self._device) if config.same_node == "auto" else None
        if self._local is not None:
            for path in local.remove_stale():
                log.warning("decode %s: removed the same-node segment %s of a decode rank "
                            "that no longer runs", self._me, path)
        self._tracker = RequestTracker(layout, rank, config, self._me)
        self._receivers: dict[tuple[str, int], ReceiverChannel] = {}
        self._retired: list[ReceiverChannel] = []
        self._lock = threading.Lock()
        self.stats = PayloadStats()
        self._rendezvous = Rendezvous(host, config, self._on_announce, instance, rank,
                                      on_tick=self._check_peers)

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` of the rendezvous store, to publish to prefill ranks."""
        return self._host, self._rendezvous.port

    def expect(self, request_id: str, num_tokens: int, prefill_tp: int,
               prefill_cp: int = 1, first_token: int = 0,
               layer_tokens: Sequence[int] | None = None) -> None:
        """Receive every layer of tokens ``[first_token, num_tokens)`` of ``request_id``
        from a prefill instance of ``prefill_cp`` x ``prefill_tp`` ranks (the plan says which
        pairs send); tokens before ``first_token`` are already in this cache (prefix cache).
        ``layer_tokens`` (DeepSeek-V4's staging rows, each layer its kind's own count): layer
        ``i`` gets only tokens ``[first_token, layer_tokens[i])``; None: ``num_tokens`` each.

        The completion deadline (``completion_timeout_s``) starts now.
        Raises ValueError if the request is already expected, ``first_token`` is not in
        ``[0, num_tokens)``, or ``layer_tokens`` is not one count in ``[0, num_tokens]`` per
        layer.
        """
        self._tracker.expect(request_id, num_tokens, prefill_tp, prefill_cp, first_token,
                             layer_tokens)

    def poll(self, request_id: str) -> KVStatus:
        """The request's state on this rank: WAITING (no record yet), TRANSFERRING, SUCCESS
        (every planned layer of every token and every planned ``done`` record arrived) or
        FAILED (failed, aborted by the prefill side, past ``completion_timeout_s``, or not
        expected here: never, or released; ``error`` says which)."""
        return self._tracker.poll(request_id)

    def release(self, request_id: str) -> None:
        """Forget the request; afterwards nothing is written into its slots (idempotent)."""
        self._tracker.release(request_id)

    def close(self) -> None:
        """Stop accepting and stop every receiver thread (bounded)."""
        self._rendezvous.close()  # NOTE: first, so its store client is ours alone below
        with self._lock:
            channels = list(self._receivers.values()) + self._retired
            self._receivers.clear()
            self._retired.clear()
        for channel in channels:
            channel.stop(self._rendezvous.store)
        bound = self._config.header_timeout_s + self._config.payload_timeout_s
        for channel in channels:
            channel.join(bound)

    def _check_peers(self) -> None:
        """Acceptor thread, every ``heartbeat_s``: give up each pair whose prefill rank sent
        neither a doorbell nor a heartbeat for ``peer_timeout_s`` (dead or hung): its
        requests fail now, its receiver ends; other pairs go on."""
        bound = self._config.peer_timeout_s
        with self._lock:
            channels = list(self._receivers.items())
        for key, channel in channels:
            silent = channel.silence(self._rendezvous.store)
            if silent <= bound:
                continue
            error = (f"{channel.source.sender} -> decode {self._me} gen {channel.generation}: "
                     f"no heartbeat from the prefill rank for {silent:.1f} s (peer_timeout_s="
                     f"{bound:g}): it died or hangs; the pair is remade on its next record")
            log.warning("KV pair lost: %s", error)
            with self._lock:
                if self._receivers.get(key) is channel:
                    del self._receivers[key]
                    self._retired.append(channel)
            channel.stop(self._rendezvous.store, abort=True)
            self._tracker.on_pair_lost(channel.source, error)

    def _on_announce(self, announce: wire.Announce) -> tuple[dict, bytes]:
        """Acceptor thread: a prefill rank opens a new pair generation; returns the ack's
        layout and same-node segment handle (b"": none)."""
        try:
            KVLayout.from_dict(announce.layout).check_compatible(self._layout)
        except (LayoutMismatchError, ValueError, KeyError, TypeError) as exc:
            # NOTE: the prefill side turns its records into aborts carrying the error
            log.warning("decode %s: prefill %s/%s has an incompatible KV layout: %s",
                        self._me, announce.instance, announce.rank, exc)
        key = (announce.instance, announce.rank)
        segment = self._same_node_segment(announce)
        channel = ReceiverChannel(self._host, self._rendezvous.port, announce, self._me,
                                  self._rank, self._cache, self._layout, self._backend,
                                  self._config, self._tracker, self.stats, segment)
        with self._lock:
            old = self._receivers.get(key)
            self._receivers[key] = channel
            self._retired = [c for c in self._retired if c.alive]
            if old is not None:
                old.stop(self._rendezvous.store)
                self._retired.append(old)
        if old is not None:
            self._tracker.on_pair_lost(
                old.source, f"{old.source.sender} -> decode {self._me}: pair generation "
                f"{old.generation} replaced by {announce.generation} (prefill restarted or "
                "remade the pair); records in flight on it were lost")
        return self._layout.to_dict(), b"" if segment is None else segment[1]

    def _same_node_segment(self, announce: wire.Announce) -> tuple[object, bytes] | None:
        """A same-node segment for the pair when the prefill rank asked for one and runs on
        this node (and ``same_node`` is ``auto``), else None (network path)."""
        if self._local is None or not announce.node or announce.node != local.node_id():
            return None
        try:
            return self._local.create(packs.segment_bytes(), self._device)
        except (OSError, RuntimeError) as exc:
            log.warning("decode %s: no same-node segment for prefill %s/%s (%s): using the "
                        "network", self._me, announce.instance, announce.rank, exc)
            return None
