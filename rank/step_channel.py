"""The SPMD step's fan-out: one TCP connection from the leader to each follower, no Ray call.

Each step the leader sends every follower one frame ``(seq, steps, step_inputs)``; the
follower's thread runs the step (forward + after_step) and answers one ack frame
``(seq, error)`` (``error`` None, or the step's exception). Ray stays the control plane
(bring-up, status, faults); this is only the per-step data.

Frames: an 8-byte big-endian length, then a pickle (the same objects Ray would pickle). The
leader unpickles only what a follower that proved it knows the channel's token sends: a
follower's hello is its rank and the 16-byte token the leader published with its address.

Bring-up: the leader's :class:`StepChannelLeader` listens at ``bind_host`` port 0 when it opens
its TP store and publishes ``host:port`` in that store under :data:`STORE_KEY`; each follower,
at the end of ``init_rank``, connects (:class:`StepChannelFollower`) and says its rank; the
leader accepts them all (bounded). Failures, as the leader sees them:

- a follower whose connection closes or resets (its process died) -> :class:`RankGone`;
- no ack (or no room to send) within the step's deadline -> :class:`RankHung`;
- a follower whose step raised, or that could not unpickle the step's frame -> that
  exception re-raised on the leader (a note names the rank), once every follower acked (the
  channel stays in step).
"""

from __future__ import annotations

import hmac
import logging
import pickle
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from rank.sockets import recv_exact
from rank.failures import RankGone, RankHung

log = logging.getLogger(__name__)

STORE_KEY = "orch/step_channel"
_LEN = struct.Struct("!Q")
_HELLO = struct.Struct("!I16s")  # follower rank, channel token
_STALE = object()  # an ack of an older step
# NOTE: the seq of an ack whose step frame the follower could not unpickle (its seq is inside
# the pickle); it answers the step in flight (frames are served in order, one at a time).
_UNREAD_SEQ = -1
# NOTE: how often a follower's idle thread looks at its stop event (seconds).
_IDLE_POLL_S = 0.5
# NOTE: how a step's RankHung message ends: a bound set below a real step reads the same.
_HUNG = "(hung, or health.step_timeout_s is below this step's time)"
# NOTE: a frame whose first byte arrived comes whole, and an ack leaves, within this
# (seconds), else the channel is broken (the leader then sees no ack: RankHung).
_FRAME_TIMEOUT_S = 60.0


def _send_frame(sock: socket.socket, payload: bytes, timeout_s: float | None) -> None:
    """Send one frame; ``timeout_s`` bounds the whole send (None: block).

    Raises:
        TimeoutError: no room to send in time. OSError: the connection is broken.
    """
    sock.settimeout(timeout_s)
    sock.sendall(_LEN.pack(len(payload)) + payload)


def _recv_frame(sock: socket.socket, deadline: float) -> bytes:
    """One frame's payload by ``deadline``; raises as
    :func:`rank.event_stream.recv_exact`."""
    (size,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
    return recv_exact(sock, size, deadline)


def _connect_options(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class StepChannelLeader:
    """Leader end: a listening socket, then one connection per follower.

    Args:
        host: the address to listen on (the instance's ``bind_host``).
        num_followers: ranks 1.. that will connect.
    """

    def __init__(self, host: str, num_followers: int) -> None:
        self.num_followers = num_followers
        self.token = secrets.token_bytes(16)
        # NOTE: a deep backlog: strangers queued before accept() must not keep followers out
        self._listener = socket.create_server((host, 0), backlog=socket.SOMAXCONN)
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._conns: dict[int, socket.socket] = {}  # follower rank -> connection
        # NOTE: a selector, not select(): a rank process may hold fds above FD_SETSIZE
        self._acks = selectors.DefaultSelector()  # every connection, data = its rank
        self._seq = 0

    def accept(self, timeout_s: float) -> None:
        """Wait (bounded) until every follower connected and said its rank. Hellos are read
        from every open connection at once, so a stranger that connects and stays silent
        (or sends half a hello) delays no follower; a wrong token is refused at once.

        Raises:
            TimeoutError: some follower did not connect within ``timeout_s`` (names them).
        """
        deadline = time.monotonic() + timeout_s
        waiting = selectors.DefaultSelector()  # the listener, and connections yet to say hello
        waiting.register(self._listener, selectors.EVENT_READ, None)
        self._listener.setblocking(False)
        try:
            while len(self._conns) < self.num_followers:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self.num_followers + 1)) - set(self._conns))
                    raise TimeoutError(f"rank(s) {missing} did not connect to the step "
                                       f"channel within {timeout_s:g} s")
                for key, _ in waiting.select(left):
                    if key.data is None:
                        self._accept_one(waiting)
                    else:
                        self._read_hello(waiting, key.fileobj, key.data)
        finally:
            for key in list(waiting.get_map().values()):
                if key.data is not None:
                    key.fileobj.close()  # strangers still silent
            waiting.close()
            self._listener.close()
        for rank, conn in self._conns.items():
            conn.setblocking(True)
            self._acks.register(conn, selectors.EVENT_READ, rank)

    def _accept_one(self, waiting: selectors.BaseSelector) -> None:
        """Accept one connection (non-blocking) and wait for its hello in ``waiting``."""
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return  # NOTE: the peer left before accept
        conn.setblocking(False)
        _connect_options(conn)
        waiting.register(conn, selectors.EVENT_READ, bytearray())

    def _read_hello(self, waiting: selectors.BaseSelector, conn: socket.socket,
                    buf: bytearray) -> None:
        """Read what ``conn`` sent of its hello; on a whole one, keep it as that rank's
        follower or refuse it (closed)."""
        try:
            chunk = conn.recv(_HELLO.size - len(buf))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        buf += chunk
        if chunk and len(buf) < _HELLO.size:
            return
        waiting.unregister(conn)
        rank, token = _HELLO.unpack(buf) if chunk else (0, b"")
        if (not hmac.compare_digest(token, self.token) or not 1 <= rank <= self.num_followers
                or rank in self._conns):
            if chunk:
                log.warning("step channel: refused a connection that is not a follower")
            conn.close()
            return
        self._conns[rank] = conn

    def run(self, steps: list, step_inputs: Any, deadline: float, bound_s: float) -> None:
        """Send one step to every follower (their threads start it at once).

        Raises:
            RankGone: a follower's connection is broken. RankHung: no room to send by
                ``deadline`` (``bound_s`` is the bound the message names).
        """
        self._seq += 1
        payload = pickle.dumps((self._seq, steps, step_inputs), pickle.HIGHEST_PROTOCOL)
        for rank, conn in sorted(self._conns.items()):
            try:
                _send_frame(conn, payload, max(1e-3, deadline - time.monotonic()))
            except TimeoutError as exc:
                raise RankHung(f"rank {rank} did not take a step within {bound_s:g} s "
                               f"{_HUNG}") from exc
            except OSError as exc:
                raise RankGone(f"rank {rank} is gone (step channel: {exc})") from exc

    def wait(self, deadline: float, bound_s: float) -> None:
        """Every follower's ack of the step last :meth:`run`; the first dead follower is
        reported as soon as its connection closes, whatever the others do.

        Raises:
            RankGone: a follower's connection closed or reset. RankHung: a follower did not
                ack by ``deadline``. Exception: what a follower's step raised (the first by
                rank, once all acked).
        """
        pending = dict(self._conns)
        errors: dict[int, BaseException] = {}
        while pending:
            left = deadline - time.monotonic()
            ready = [key.data for key, _ in self._acks.select(max(0.0, left))]
            if not ready:
                raise RankHung(f"rank {min(pending)} did not finish a step within "
                               f"{bound_s:g} s {_HUNG}")
            # NOTE: a rank that acked already is read too: its connection can only have
            # closed (RankGone at once), else the selector would report it again and again
            for rank in ready:
                error = self._read_ack(rank, self._conns[rank], deadline, bound_s)
                if error is not _STALE and rank in pending:
                    del pending[rank]
                    if error is not None:
                        errors[rank] = error
        if errors:
            rank = min(errors)
            errors[rank].add_note(f"(raised by rank {rank}'s step)")
            raise errors[rank]

    def _read_ack(self, rank: int, conn: socket.socket, deadline: float,
                  bound_s: float) -> Any:
        """One ack frame from ``rank``: its error (None: ok), or ``_STALE`` for an older
        step's ack."""
        try:
            seq, error_pickle, error_text = pickle.loads(_recv_frame(conn, deadline))
        except TimeoutError as exc:
            raise RankHung(f"rank {rank} did not finish a step within {bound_s:g} s "
                           f"{_HUNG}") from exc
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            raise RankGone(f"rank {rank} is gone (step channel: {exc or 'closed'})") from exc
        if seq != self._seq and seq != _UNREAD_SEQ:
            return _STALE
        if error_text is None:
            return None
        try:
            return pickle.loads(error_pickle)
        except Exception:  # noqa: BLE001 - an exception type the leader cannot rebuild
            return RuntimeError(error_text)

    def close(self) -> None:
        """Close every connection (followers' threads see the end and stop); idempotent."""
        self._listener.close()
        self._acks.close()
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()



class StepChannelFollower:
    """Follower end: connects to the leader and serves steps on its own thread.

    Args:
        address: the leader's ``(host, port)``.
        token: the leader's channel token (``StepChannelLeader.token``).
        rank: this follower's rank (>= 1).
        run_step: ``run_step(steps, step_inputs)``, the rank's step (forward + after_step).
        name: thread name (e.g. ``"decode-0:1-steps"``).
        timeout_s: bound of the connect.

    Raises:
        OSError: the leader could not be reached within ``timeout_s``.
    """

    def __init__(self, address: tuple[str, int], token: bytes, rank: int,
                 run_step: Callable[[list, Any], None], name: str, timeout_s: float) -> None:
        self._run_step = run_step
        self._stop = threading.Event()
        self._sock = socket.create_connection(address, timeout=timeout_s)
        _connect_options(self._sock)
        self._steps = selectors.DefaultSelector()  # NOTE: not select(): fds may be > 1024
        self._steps.register(self._sock, selectors.EVENT_READ)
        self._sock.settimeout(timeout_s)
        self._sock.sendall(_HELLO.pack(rank, token))
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Step frames -> run -> ack, until the leader closes or :meth:`close`. A step's
        error goes back in the ack; only a broken connection ends the thread."""
        while not self._stop.is_set():
            try:
                if not self._steps.select(_IDLE_POLL_S):
                    continue  # idle
                payload = _recv_frame(self._sock, time.monotonic() + _FRAME_TIMEOUT_S)
            except (OSError, ValueError) as exc:  # ValueError: a closed socket
                if not self._stop.is_set():
                    log.info("%s: step channel closed (%s)", self._thread.name, exc)
                return
            ack = self._run(payload)
            try:
                _send_frame(self._sock, ack, _FRAME_TIMEOUT_S)
            except OSError as exc:  # TimeoutError included: the leader stopped reading
                log.info("%s: step channel closed (%s)", self._thread.name, exc)
                return

    def _run(self, payload: bytes) -> bytes:
        """Run one step frame; the pickled ack ``(seq, error pickle, error text)``
        (``_UNREAD_SEQ`` when the frame cannot be unpickled)."""
        seq = _UNREAD_SEQ
        try:
            seq, steps, step_inputs = pickle.loads(payload)
            self._run_step(steps, step_inputs)
            return pickle.dumps((seq, None, None))
        except Exception as exc:  # noqa: BLE001 - the leader re-raises it
            text = f"{type(exc).__name__}: {exc}"
            try:
                error_pickle = pickle.dumps(exc)
            except Exception:  # noqa: BLE001 - not picklable: the text still goes
                error_pickle = b""
            return pickle.dumps((seq, error_pickle, text))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (bounded by ``timeout_s``) and close the connection; idempotent."""
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's wait at once
        except OSError:  # already closed or never connected
            pass
        self._thread.join(timeout_s)
        self._steps.close()
        self._sock.close()


def open_leader(store: Any, host: str, num_followers: int) -> StepChannelLeader:
    """Leader, when it opens its TP store (a ``torch.distributed.TCPStore``): listen at
    ``host`` port 0 and publish the address in ``store`` under :data:`STORE_KEY`."""
    leader = StepChannelLeader(host, num_followers)
    store.set(STORE_KEY, f"{leader.token.hex()}@{leader.address[0]}:{leader.address[1]}")
    return leader


def connect_follower(store_address: tuple[str, int], rank: int,
                     run_step: Callable[[list, Any], None], name: str,
                     timeout_s: float) -> StepChannelFollower:
    """A follower: read the leader's address from the TP store at ``store_address`` and
    connect (arguments as :class:`StepChannelFollower`), all within ``timeout_s`` each.

    Raises:
        torch.distributed.DistStoreError: the address was not published in time.
        OSError: the leader could not be reached.
    """
    from torch.distributed import TCPStore

    store = TCPStore(*store_address, is_master=False, timeout=timedelta(seconds=timeout_s))
    token, address = store.get(STORE_KEY).decode().split("@", 1)
    host, port = address.rsplit(":", 1)
    return StepChannelFollower((host, int(port)), bytes.fromhex(token), rank, run_step, name,
                               timeout_s)
