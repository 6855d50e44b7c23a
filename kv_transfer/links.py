"""Pack pipelines of one pair generation: how packs (:mod:`~kv_transfer.packs`) move.

Two transports, the same calls on each side:

- network (:class:`NetSender` / :class:`NetReceiver`): a pack is one message on the pair's
  process group, from a pooled staging buffer; the receiver posts the receives of the next
  ``PACK_DEPTH`` packs before it waits for the first.
- same node (:class:`LocalSender` / :class:`LocalReceiver`): the pack is gathered straight
  into slot ``seq % PACK_DEPTH`` of the pair's shared segment (:mod:`~kv_transfer.local`); a
  one-element "ready" message (the pack's sequence number, a host tensor) on the group rings
  the decode side, which scatters from the slot and answers with an "ack" message once the
  scatter finished on the device; the sender reuses a slot only after its ack. A same-node
  pair's group is gloo whatever the device (:func:`~kv_transfer.pair.group_backend`), so
  two ranks on one GPU never need an NCCL communicator between them.

Sender: ``take(nbytes)`` (a staging tensor; waits, bounded, while ``PACK_DEPTH`` packs are in
flight), gather into it, ``post(...)`` (returns the pack's sequence number), and later
``wait(seq)`` (every pack up to ``seq`` left: its source rows may change); ``drain()``
before the pair is closed (same node: every pack acked, so the decode rank's last acks never
meet a closed pair). Receiver:
``receive(sizes)`` yields each pack's bytes in order; the pack's memory is reused once the
caller asks for the next one. Every wait is bounded by ``payload_timeout_s``; errors are the
pair's :class:`~kv_transfer.errors.TransferError`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch

from kv_transfer import local, packs, payload
from kv_transfer.errors import WireError
from kv_transfer.local import LocalBackend
from kv_transfer.pair import PairGroup


class NetSender:
    """Prefill side, network transport (see module docstring)."""

    def __init__(self, pair: PairGroup, device: torch.device, timeout_s: float) -> None:
        self._pair, self._device, self._timeout_s = pair, device, timeout_s
        self._pool = payload.BufferPool(keep=packs.PACK_DEPTH + 1)
        self._flight: deque[tuple[int, object, torch.Tensor]] = deque()  # (seq, work, buf)
        self._seq = 0

    def take(self, nbytes: int, what: str) -> torch.Tensor:
        while len(self._flight) >= packs.PACK_DEPTH:
            self._retire(what)
        return self._pool.take(nbytes, self._device)

    def post(self, buf: torch.Tensor, nbytes: int, what: str) -> int:
        self._seq += 1
        work = self._pair.post([buf[:nbytes]], what)[0]
        self._flight.append((self._seq, work, buf))
        return self._seq

    def wait(self, upto: int, what: str) -> None:
        while self._flight and self._flight[0][0] <= upto:
            self._retire(what)

    def drain(self, what: str) -> None:
        """Wait (bounded, each) until every pack posted left (before the pair is closed)."""
        self.wait(self._seq, what)

    def _retire(self, what: str) -> None:
        _, work, buf = self._flight[0]
        self._pair.wait_sent([work], self._timeout_s, what)
        self._flight.popleft()
        self._pool.give(buf)


class LocalSender:
    """Prefill side, same-node transport over ``segment`` (see module docstring)."""

    def __init__(self, pair: PairGroup, segment: torch.Tensor, local: LocalBackend,
                 device: torch.device, timeout_s: float) -> None:
        self._pair, self._segment, self._local = pair, segment, local
        self._device, self._timeout_s = device, timeout_s
        self._ready: deque[tuple[int, object, torch.Tensor]] = deque()  # (seq, work, msg)
        self._acks: deque[tuple[object, torch.Tensor]] = deque()  # posted ack receives
        self._seq = 0

    def take(self, nbytes: int, what: str) -> torch.Tensor:
        if len(self._acks) >= packs.PACK_DEPTH:  # NOTE: the slot is free once its pack was acked
            work, _ = self._acks[0]
            self._pair.wait_sent([work], self._timeout_s, f"{what}: ack of a slot")
            self._acks.popleft()
        slot = self._seq % packs.PACK_DEPTH
        return self._segment[slot * packs.PACK_BYTES:(slot + 1) * packs.PACK_BYTES]

    def post(self, buf: torch.Tensor, nbytes: int, what: str) -> int:
        self._local.sync(self._device)
        self._seq += 1
        ack = torch.zeros(1, dtype=torch.int64)
        self._acks.append((self._pair.post_recv(ack, what), ack))
        msg = torch.tensor([self._seq], dtype=torch.int64)
        self._ready.append((self._seq, self._pair.post([msg], what)[0], msg))
        while len(self._ready) > 1 and self._ready[0][1].is_completed():
            self._ready.popleft()
        return self._seq

    def wait(self, upto: int, what: str) -> None:
        while self._ready and self._ready[0][0] <= upto:
            self._pair.wait_sent([self._ready[0][1]], self._timeout_s, what)
            self._ready.popleft()

    def drain(self, what: str) -> None:
        """Wait (bounded, each) for every ready message to leave and every pack's ack.

        A sender may report a request done once its ready messages left (the bytes are in
        the segment, which the decode rank keeps mapped), but the decode rank still acks
        each pack after scattering it: a pair closed before those acks arrive (the
        connector closed, the process exited) makes the decode rank's ack send meet a closed
        socket, and gloo fails the record whose bytes all arrived ("Connection closed by
        peer"). So the pair is closed only after this.
        """
        self.wait(self._seq, what)
        while self._acks:
            self._pair.wait_sent([self._acks[0][0]], self._timeout_s, f"{what}: ack of a slot")
            self._acks.popleft()


class NetReceiver:
    """Decode side, network transport."""

    def __init__(self, pair: PairGroup, device: torch.device, timeout_s: float) -> None:
        self._pair, self._device, self._timeout_s = pair, device, timeout_s
        self._pool = payload.BufferPool(keep=packs.PACK_DEPTH + 1)

    def receive(self, sizes: list[int], what: str) -> Iterator[torch.Tensor]:
        """Each pack's bytes (uint8 ``[sizes[i]]``), in order."""
        posted: deque[tuple[object, torch.Tensor]] = deque()

        def post(i: int) -> None:
            buf = self._pool.take(sizes[i], self._device)
            posted.append((self._pair.post_recv(buf[:sizes[i]], what), buf))
        for i in range(min(packs.PACK_DEPTH, len(sizes))):
            post(i)
        for i, size in enumerate(sizes):
            work, buf = posted.popleft()
            self._pair.wait_sent([work], self._timeout_s, what)
            yield buf[:size]
            self._pool.give(buf)
            if i + packs.PACK_DEPTH < len(sizes):
                post(i + packs.PACK_DEPTH)


class LocalReceiver:
    """Decode side, same-node transport over ``segment``."""

    def __init__(self, pair: PairGroup, segment: torch.Tensor, device: torch.device,
                 timeout_s: float) -> None:
        self._pair, self._segment = pair, segment
        self._device, self._timeout_s = device, timeout_s
        self._local = local.local_backend(device)
        self._acks: deque[tuple[object, torch.Tensor]] = deque()
        self._seq = 0

    def receive(self, sizes: list[int], what: str) -> Iterator[torch.Tensor]:
        """Each pack's bytes, a view of its slot (valid until the next pack is asked for)."""
        ready = [torch.zeros(1, dtype=torch.int64) for _ in sizes]
        works = [self._pair.post_recv(t, what) for t in ready]
        for size, work, msg in zip(sizes, works, ready):
            self._pair.wait_sent([work], self._timeout_s, what)
            slot = self._seq % packs.PACK_DEPTH
            self._seq += 1
            if int(msg) != self._seq:
                raise WireError(f"{self._pair.name}: {what}: pack {int(msg)} rang, expected "
                                f"{self._seq}: the pair is out of step")
            yield self._segment[slot * packs.PACK_BYTES:slot * packs.PACK_BYTES + size]
            self._ack(what)

    def _ack(self, what: str) -> None:
        self._local.sync(self._device)  # NOTE: the scatter out of the slot is done
        ack = torch.tensor([self._seq], dtype=torch.int64)
        self._acks.append((self._pair.post([ack], what)[0], ack))
        while len(self._acks) > packs.PACK_DEPTH:
            self._pair.wait_sent([self._acks[0][0]], self._timeout_s, what)
            self._acks.popleft()
