"""A 2-rank communicator per (prefill rank, decode rank) pair, without a global world.

Rendezvous: the decode rank hosts a ``TCPStore`` server (:class:`Rendezvous`, port 0 ->
``address``). A prefill rank, on first use, connects a store client and:

1. takes a fresh generation ``g = add("gen/<instance>/<rank>", 1)``; the pair's keys live
   under ``prefix = "pair/<instance>/<rank>/<g>"``, so a restarted peer never meets a stale
   group;
2. posts an :class:`~kv_transfer.wire.Announce` (its layout) at ``announce/<n>``;
3. waits for the decode side's :class:`~kv_transfer.wire.Ack` at ``<prefix>/ack``;
4. both build the group (prefill = rank 0, decode = rank 1) from ``PrefixStore(prefix/pg)``.

Every record is announced by a doorbell key ``<prefix>/doorbell/<n>`` holding its msgpack
header. The receiver blocks in ``store.get`` on it, so an idle receiver is woken at once by a
record or by a ``stop`` value (:meth:`PairGroup.wake`), and a gloo wait never has to time
out on an idle pair (a timed-out gloo wait closes the pair).

Liveness: the sender adds 1 to ``<prefix>/alive`` every ``heartbeat_s`` (:meth:`PairGroup.beat`);
on the decode side the acceptor thread reads the counters every ``heartbeat_s`` (the
``on_tick`` of :class:`Rendezvous`; :meth:`PairGroup.beats`), and the connector gives up a
pair whose receiver waited for a doorbell while the counter stood still for
``peer_timeout_s`` (prefill rank dead or hung). Neither a gloo wait (a timed-out one closes
the pair) nor a store ``get`` with a short timeout (c10d logs a warning per timeout) can
serve as the probe.

Dead addresses: :func:`connect` first opens a plain TCP connection (bounded), so a decode
rank whose process is gone is reported at once ("connection refused") instead of after the
store client's retries for ``connect_timeout_s``. A hung one (SIGSTOP: the kernel still
accepts TCP) would hold TCPStore's constructor forever: it is bounded by :func:`_open_store`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from engine.error_text import first_line
from kv_transfer import local, packs, wire
from kv_transfer.backend import PairBackend, backend_for
from kv_transfer.config import TransferConfig
from kv_transfer.errors import TransferError, TransferTimeout, WireError

log = logging.getLogger(__name__)
PREFILL, DECODE = 0, 1  # ranks inside a pair group
STOP = b"stop"  # doorbell value that ends a receiver's wait
_IDLE_WAIT_S = 3600.0  # one store wait of an idle receiver (it just waits again)
_PROBE_S = 5.0  # bound on the plain TCP connect that tells a dead address at once


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@dataclass
class PairGroup:
    """One generation of one pair: the 2-rank group plus the store used for doorbells.

    Errors of the record methods (:meth:`post_doorbell`, :meth:`post`, :meth:`wait_sent`,
    :meth:`recv_all`) are :class:`TransferError` (:class:`TransferTimeout` for a bound that
    ran out) with ``pair`` = ``name``; the doorbell wait and :meth:`wake` raise the store's.

    Attributes:
        name: ``"prefill <inst>/<rank> -> decode <inst>/<rank> gen <g>"`` for error messages.
        peer_layout: the other side's layout dict (handshake).
        doorbells: doorbells posted (prefill side) or taken (decode side) so far.
    """

    name: str
    group: dist.ProcessGroup
    store: dist.Store
    prefix: str
    generation: int
    rank: int
    backend: PairBackend
    peer_layout: dict
    doorbells: int = 0
    local: torch.Tensor | None = None  # same-node segment both ranks mapped (uint8), if any

    def post_doorbell(self, header: bytes, what: str) -> None:
        """Prefill side: announce the next record; the doorbell value is its msgpack header
        (so the header costs no message on the group, and no round trip)."""
        self.doorbells += 1
        with self._errors(what):
            self.store.set(self._doorbell_key(self.doorbells), header)

    def beat(self) -> None:
        """Prefill side: post one heartbeat (see the module docstring, Liveness)."""
        with self._errors("heartbeat"):
            self.store.add(self._alive_key(), 1)

    def beats(self, store: dist.Store) -> int:
        """Decode side: heartbeats posted so far, read through ``store`` (another client)."""
        return int(store.add(self._alive_key(), 0))

    def wait_doorbell(self, stop: threading.Event) -> bytes | None:
        """Decode side: header bytes of the next record; None once ``stop`` is set.

        Blocks in the store's ``get`` (no polling, no latency; the receiver's store client
        has an ``_IDLE_WAIT_S`` timeout, after which it just waits again); :meth:`wake`
        (from another store client) posts ``stop`` as the next doorbell to end the wait at once.

        Raises:
            torch.distributed.DistNetworkError: the store is gone (the decode rank closed).
        """
        key = self._doorbell_key(self.doorbells + 1)
        while not stop.is_set():
            try:
                value = self.store.get(key)
            except dist.DistStoreError:  # NOTE: get() timed out: idle for _IDLE_WAIT_S
                continue
            self.store.delete_key(key)
            if value == STOP or stop.is_set():
                return None
            self.doorbells += 1
            return value
        return None

    def wake(self, store: dist.Store) -> None:
        """Post ``stop`` as this pair's next doorbell through ``store`` (another client)."""
        store.set(self._doorbell_key(self.doorbells + 1), STOP)

    def post(self, tensors: list[torch.Tensor], what: str) -> list[dist.Work]:
        """Post sends of ``tensors`` in order; the caller keeps them alive until waited."""
        with self._errors(what):
            return [self.group.send([t], 1 - self.rank, 0) for t in tensors]

    def post_recv(self, tensor: torch.Tensor, what: str) -> dist.Work:
        """Post a receive into ``tensor`` (kept alive by the caller until waited)."""
        with self._errors(what):
            return self.group.recv([tensor], 1 - self.rank, 0)

    def wait_sent(self, works: list[dist.Work], timeout_s: float, what: str) -> None:
        """Wait (bounded, each) for sends of :meth:`post` (or receives of :meth:`post_recv`)."""
        with self._errors(what):
            for work in works:
                self.backend.wait(work, timeout_s)

    def recv_all(self, tensors: list[torch.Tensor], timeout_s: float, what: str) -> None:
        """Receive into ``tensors`` in order: all receives are posted before the first wait
        (no round trip between messages); each wait is bounded by ``timeout_s``."""
        with self._errors(what):
            works = [self.group.recv([t], 1 - self.rank, 0) for t in tensors]
            for work in works:
                self.backend.wait(work, timeout_s)

    def abort(self) -> None:
        """Tear the failed group's communicator down (:meth:`PairBackend.abort`: NCCL/HCCL
        ``abort()``, nothing for gloo), so a dead or hung peer fails only this pair and the
        rank process lives on; the pair is remade on next use. Never raises."""
        self.backend.abort(self.group)

    def _doorbell_key(self, n: int) -> str:
        return f"{self.prefix}/doorbell/{n}"

    def _alive_key(self) -> str:
        return f"{self.prefix}/alive"

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Turn backend/store errors into TransferError naming the pair and the record."""
        try:
            yield
        except TransferTimeout as exc:
            raise TransferTimeout(f"{self.name}: {what}: {exc}", pair=self.name) from exc
        except Exception as exc:  # gloo/store errors are RuntimeError subclasses
            raise TransferError(f"{self.name}: {what} failed: {first_line(exc)} (the peer "
                                "died or closed the pair; it is remade on next use)",
                                pair=self.name) from exc


def connect(host: str, port: int, instance: str, rank: int, peer: str, layout: dict,
            backend: PairBackend, config: TransferConfig, device: torch.device) -> PairGroup:
    """Prefill side: open a new pair generation with the decode rank at ``host:port``.

    With ``config.same_node == "auto"`` the announce carries this node's id; when the decode
    rank answers with a same-node segment (:mod:`~kv_transfer.local`) that maps here, the
    pair's ``local`` is that segment (the decode rank learns it from ``<prefix>/local``).

    Raises:
        TransferTimeout / TransferError: the decode rank did not answer within
            ``connect_timeout_s`` (message says which address and what to check).
    """
    where = f"prefill {instance}/{rank} -> decode {peer} at {host}:{port}"
    try:
        socket.create_connection((host, port), timeout=min(_PROBE_S,
                                                           config.connect_timeout_s)).close()
    except OSError as exc:
        raise TransferError(f"{where}: cannot connect ({exc}): the decode rank is gone or its "
                            "address is stale; its requests fail, and the pair is remade when "
                            "the rank is back at a new address", pair=where) from None
    try:
        store = _open_store(host, port, config.connect_timeout_s)
        gen = store.add(f"gen/{instance}/{rank}", 1)
        prefix = f"pair/{instance}/{rank}/{gen}"
        n = store.add("announce/count", 1)
        node = local.node_id() if config.same_node == "auto" else ""
        store.set(f"announce/{n}", wire.pack(wire.Announce(instance, rank, gen, layout, node)))
        store.wait([f"{prefix}/ack"], _td(config.connect_timeout_s))
        ack = wire.unpack(store.get(f"{prefix}/ack"), wire.Ack)
        name = f"{where} gen {gen}"
        segment = _map_segment(ack.local, device, name)
        store.set(f"{prefix}/local", b"1" if segment is not None else b"0")
        backend = group_backend(backend, segment is not None)
        group = backend.make_group(dist.PrefixStore(f"{prefix}/pg", store), PREFILL,
                                   config.connect_timeout_s, host)
    except WireError as exc:
        raise TransferError(f"{where}: {exc}", pair=where) from exc
    except Exception as exc:  # store/gloo connection errors
        raise TransferTimeout(
            f"{where}: could not connect within {config.connect_timeout_s:g} s "
            f"({first_line(exc)}); check that the decode rank is alive and its published "
            "address is current", pair=where) from exc
    return PairGroup(name, group, store, prefix, gen, PREFILL, backend, ack.layout,
                     local=segment)


def group_backend(backend: PairBackend, same_node: bool) -> PairBackend:
    """The backend of a pair's group: gloo for a same-node pair (its group only carries the
    8-byte ready/ack messages, :mod:`~kv_transfer.links`; NCCL refuses two ranks on one GPU,
    and a device communicator would cost its buffers for nothing), else ``backend``."""
    return backend_for("cpu") if same_node and backend.name != "gloo" else backend


def _map_segment(handle: bytes, device: torch.device, name: str) -> torch.Tensor | None:
    """Prefill side: map the decode rank's same-node segment and unlink it (both mapped it
    now); None (network path) when there is none or it does not map here."""
    backend = local.local_backend(device)
    if not handle or backend is None:
        return None
    try:
        return backend.open(handle, packs.segment_bytes(), device)
    except (OSError, RuntimeError) as exc:
        log.warning("%s: same-node segment does not map here (%s): using the network", name, exc)
        return None
    finally:
        backend.unlink(handle)


def accept(host: str, port: int, announce: wire.Announce, me: str, backend: PairBackend,
           config: TransferConfig, segment: torch.Tensor | None = None) -> PairGroup:
    """Decode side: join the group the prefill rank of ``announce`` is building.

    Called after the ack was posted (see :class:`Rendezvous`); ``segment``: the same-node
    segment the ack named, kept as the pair's ``local`` when the prefill rank mapped it.
    Raises TransferTimeout when the prefill rank does not join within ``connect_timeout_s``.
    """
    prefix = f"pair/{announce.instance}/{announce.rank}/{announce.generation}"
    name = (f"prefill {announce.instance}/{announce.rank} -> decode {me} "
            f"gen {announce.generation}")
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=_td(config.connect_timeout_s),
                              wait_for_workers=False)
        mapped = store.get(f"{prefix}/local") == b"1"  # NOTE: set before the prefill's group
        backend = group_backend(backend, mapped)
        group = backend.make_group(dist.PrefixStore(f"{prefix}/pg", store), DECODE,
                                   config.connect_timeout_s, host)
        store.set_timeout(_td(_IDLE_WAIT_S))  # NOTE: this client's get() waits for doorbells
    except Exception as exc:
        raise TransferTimeout(f"{name}: group not built within {config.connect_timeout_s:g} s "
                              f"({first_line(exc)})", pair=name) from exc
    return PairGroup(name, group, store, prefix, announce.generation, DECODE, backend,
                     announce.layout, local=segment if mapped else None)


class Rendezvous:
    """Decode side: the TCPStore server and the thread that accepts announced pairs.

    ``on_announce(announce) -> (ack_layout, local_handle)`` runs on the acceptor thread for
    each new pair generation; it returns the decode layout dict and the same-node segment's
    handle (``b""``: none) to post as the ack (and typically starts a receiver that calls
    :func:`accept`). ``on_tick()`` runs on it every ``heartbeat_s`` (the
    liveness check of the pairs); errors of both are logged, never end the thread.
    """

    def __init__(self, host: str, config: TransferConfig,
                 on_announce: Callable[[wire.Announce], tuple[dict, bytes]], instance: str,
                 rank: int, on_tick: Callable[[], None] | None = None) -> None:
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=_td(config.connect_timeout_s))
        self.port = self._store.port
        self.store = self._store  # NOTE: also used to wake receivers (their own clients block)
        self._instance, self._rank = instance, rank
        me = f"{instance}/{rank}"
        self._me = me
        self._on_announce = on_announce
        self._on_tick = on_tick
        self._poll_s, self._tick_s = config.poll_interval_s, config.heartbeat_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-accept-{me}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n, next_tick = 1, time.monotonic() + self._tick_s
        while not self._stop.wait(self._poll_s):
            n = self._accept_new(n)
            if self._on_tick is not None and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self._tick_s
                try:
                    self._on_tick()
                except Exception:  # noqa: BLE001 - a failed check must not stop the acceptor
                    log.exception("decode %s: pair liveness check failed", self._me)

    def _accept_new(self, n: int) -> int:
        """Answer announcements ``n``, ``n + 1``, ... that arrived; the next number to read."""
        while self._store.check([f"announce/{n}"]):
            raw = self._store.get(f"announce/{n}")
            self._store.delete_key(f"announce/{n}")
            n += 1
            try:
                announce = wire.unpack(raw, wire.Announce)
                prefix = f"pair/{announce.instance}/{announce.rank}/{announce.generation}"
                layout, handle = self._on_announce(announce)
                self._store.set(f"{prefix}/ack",
                                wire.pack(wire.Ack(self._instance, self._rank, layout, handle)))
            except Exception:  # one bad peer must not stop the acceptor
                log.exception("decode %s: rejected a pair announcement", self._me)
        return n

    def close(self) -> None:
        """Stop accepting (the store server stays up until this object is dropped)."""
        self._stop.set()
        self._thread.join(timeout=5.0)


def _open_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A store client of ``host:port`` whose ops wait up to ``timeout_s``; made within
    ``timeout_s`` or TransferTimeout.

    NOTE: TCPStore's constructor waits for the server's answer to its ping without a bound
    (a SIGSTOPped process's kernel accepts the connection, nobody answers), so it runs on a
    daemon thread ``kv-connect-<host>:<port>``; after a timeout that thread ends when the
    peer answers or its socket closes (the hung rank is killed or resumes), and the store it
    made is dropped.
    """
    made: list = []
    done = threading.Event()

    def open_store() -> None:
        try:
            made.append(dist.TCPStore(host, port, is_master=False, timeout=_td(timeout_s),
                                      wait_for_workers=False))
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            made.append(exc)
        done.set()
    threading.Thread(target=open_store, name=f"kv-connect-{host}:{port}", daemon=True).start()
    if not done.wait(timeout_s):
        raise TransferTimeout(f"no answer from the store at {host}:{port} within {timeout_s:g} s "
                              "(the process accepts TCP but hangs)")
    if isinstance(made[0], Exception):
        raise made[0]
    return made[0]
