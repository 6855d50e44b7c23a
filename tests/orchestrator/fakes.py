"""In-process fake leaders for router tests: scripted tokens, recorded calls, failure modes.

Each fake behaves like the real leader contract (rank.messages docstring) and records every
call in ``calls`` so tests can check what reached it. ``Remote(obj)`` makes ``obj`` look like
a Ray actor handle: ``handle.method.remote(*args)`` returns an awaitable.

Stages are made deterministic with ``hold(method)`` (the calls wait until the test releases
them; the test learns when one entered) and failures with ``errors[method] = message`` (the
call raises, as a dead or broken actor's call does).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect

from kv_transfer import KVPeer
from rank.call_server import CallServer
from rank.event_stream import EventStream
from rank.messages import (Abort, Admit, Attach, Generate, InstanceStatusInfo, Prefill, Rejection,
                           Reservation, Reserve, TokenEvent)

VOCAB = 129_280
CALL_WAIT_S = 30.0  # a call over the fake's call server waits this long for its handler
EOS = 1
# NOTE: what one request commits in a fake DeepSeek-V4 decode's KV group pools
V4_NEED = {"window": 2, "entries/compressed_sparse_attention": 3,
           "state/compressed_sparse_attention": 1}


def expected_tokens(prompt: tuple[int, ...], max_tokens: int, ignore_eos: bool = True):
    """The script every fake follows: token i = (sum(prompt) + 7 i) % VOCAB, EOS stops."""
    out = []
    for i in range(max_tokens):
        tok = (sum(prompt) + 7 * i) % VOCAB
        out.append(tok)
        if tok == EOS and not ignore_eos:
            break
    return out


def scripted(spec) -> list[int]:
    """The tokens a fake emits for ``spec``: the script of its original prompt, from output
    token ``spec.num_resumed_tokens`` on (a migrated request goes on where it stopped, as a
    model would, its prompt ending with the streamed tokens)."""
    done = spec.num_resumed_tokens
    prompt = spec.prompt_token_ids[:len(spec.prompt_token_ids) - done]
    return expected_tokens(prompt, done + spec.sampling.max_tokens,
                           spec.sampling.ignore_eos)[done:]


class Remote:
    """Ray-handle look-alike around an in-process object."""

    def __init__(self, obj) -> None:
        self.obj = obj

    def __getattr__(self, name):
        fn = getattr(self.obj, name)

        class _Method:
            @staticmethod
            def remote(*args):
                async def run():
                    result = fn(*args)
                    return await result if inspect.isawaitable(result) else result
                return run()

            @staticmethod
            def options(**_):  # e.g. concurrency_group: one in-process object has none
                return _Method
        return _Method


class _Leader:
    def __init__(self, name: str, role: str) -> None:
        self.name, self.role = name, role
        self.calls: list[tuple] = []
        self.stream = EventStream(name, "127.0.0.1")  # the real leader end of the token path
        self._poll_error: str | None = None
        self.poll_failures = 0  # subscriptions refused because of poll_error
        self.silent = False  # never emits anything
        self.errors: dict[str, str] = {}  # method -> its calls raise RuntimeError(message)
        self.dead: str | None = None  # every call raises this (see die)
        self._holds: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}
        self.call_server: CallServer | None = None  # from open_calls
        self._running: set[concurrent.futures.Future] = set()  # its calls on the loop

    def hold(self, method: str) -> tuple[asyncio.Event, asyncio.Event]:
        """Calls of ``method`` wait from now on (``"events"``: the events sent from now on): returns
        (entered: set when one waits, release: set it to let them all go on)."""
        entered, release = asyncio.Event(), asyncio.Event()
        self._holds[method] = (entered, release)
        return entered, release

    @property
    def poll_error(self) -> str | None:
        """Set: the event stream breaks and every new subscription raises this (a leader
        whose events cannot be followed)."""
        return self._poll_error

    @poll_error.setter
    def poll_error(self, reason: str | None) -> None:
        self._poll_error = reason
        if reason:  # NOTE: like a leader process gone: a later subscription meets a new one
            self.stream.close()

    def die(self, reason: str = "ActorDiedError: the actor died unexpectedly") -> None:
        """Like a killed rank process: from now on every call (streams, probes) raises."""
        self.dead = self.poll_error = reason

    def free_blocks(self) -> int:
        """What the leader reports with each event frame."""
        return 8

    def group_free(self) -> dict[str, int] | None:
        """DeepSeek-V4's uncommitted blocks per KV group, reported with each frame (None:
        not V4)."""
        return None

    def flush(self) -> None:
        """One frame, as the leader's loop makes after each iteration (only when something
        changed)."""
        self.stream.flush(self.free_blocks(), None, self.group_free())

    async def _enter(self, method: str) -> None:
        """At the start of ``method``: raise when dead, wait while held, raise its injected
        error."""
        if self.dead:
            raise RuntimeError(self.dead)
        hold = self._holds.get(method)
        if hold is not None:
            hold[0].set()
            await hold[1].wait()
        if method in self.errors:
            raise RuntimeError(self.errors[method])

    def open_events(self, subscriber: str, beat_s=None, status_s=None):
        if self.poll_error:
            self.poll_failures += 1
            raise RuntimeError(self.poll_error)
        if self.stream.closed:
            self.stream = EventStream(self.name, "127.0.0.1")
        address = self.stream.open(subscriber)
        self.flush()  # NOTE: what was emitted before, as a leader's loop
        return address

    def open_calls(self):
        """``Rank.open_calls``: a real call server (rank/call_server.py) whose calls run
        :meth:`request` on this fake's event loop, as its Ray calls do."""
        if self.dead:
            raise RuntimeError(self.dead)
        if self.call_server is None:
            loop = asyncio.get_running_loop()

            def handle(request):
                async def run():
                    result = self.request(request)
                    return await result if inspect.isawaitable(result) else result
                future = asyncio.run_coroutine_threadsafe(run(), loop)
                self._running.add(future)
                try:
                    return future.result(CALL_WAIT_S)
                finally:
                    self._running.discard(future)
            self.call_server = CallServer(self.name, "127.0.0.1", handle)
        return self.call_server.open()

    def close_calls(self) -> None:
        """Close the call server (as the rank's shutdown does); the calls still waiting on
        the loop are cancelled, so no handler thread outlives the test."""
        for future in list(self._running):
            future.cancel()
        if self.call_server is not None:
            self.call_server.close()

    def _publish(self, event: TokenEvent) -> None:
        """Send ``event`` on the stream now; while ``hold("events")`` is not released, once it
        is (in order)."""
        self.stream.add(event)
        hold = self._holds.get("events")
        if hold is None or hold[1].is_set():
            self.flush()
            return
        if not hold[0].is_set():
            hold[0].set()
            release = asyncio.ensure_future(hold[1].wait())
            release.add_done_callback(lambda _: self.flush())

    def emit(self, request_id, tokens, finish=None, source=None, error=None, cached=0):
        if not self.silent:
            self._publish(TokenEvent(request_id, tuple(tokens), finish, error,
                                     source or self.role, self.name,
                                     num_cached_tokens=cached))

    def emit_error(self, request_id, error: str, retryable: bool = False) -> None:
        """An error event of ``request_id`` from this instance."""
        self._publish(TokenEvent(request_id, (), "error", error, self.role, self.name,
                                 retryable=retryable))

    def request(self, request):
        """``Rank.request``: one router request (rank.messages) to the fake's method of it."""
        match request:
            case Reserve(spec, prefill_tp, prefill_cp):
                return self.reserve(spec, prefill_tp, prefill_cp)
            case Prefill(spec, reservation):
                return self.prefill(spec, reservation)
            case Attach(request_id, reservation):
                return self.attach(request_id, reservation)
            case Admit(request_id, first_token_id):
                return self.admit(request_id, first_token_id)
            case Generate(spec):
                return self.generate(spec)
            case Abort(request_id):
                return self.abort(request_id)
        raise TypeError(f"{self.name} does not take {request!r}")

    def abort(self, request_id: str) -> bool:
        self.calls.append(("abort", request_id))
        return True

    def node_info(self) -> tuple[str, str]:  # the health monitor's probe
        if self.dead:
            raise RuntimeError(self.dead)
        return "node-a", "cpu"

    def status(self) -> InstanceStatusInfo:
        return InstanceStatusInfo(name=self.name, role=self.role, tp=1,
                                  ranks=((0, "node-a", "cpu", 4242),), queue_depth=0, running=0,
                                  free_blocks=10, total_blocks=10)


class FakeDecode(_Leader):
    """Reserves ``blocks`` one-block-per-request slots; emits tokens 2.. after admit.

    ``groups``: a DeepSeek-V4 decode: KV group -> blocks of its pool; each request also
    commits :data:`V4_NEED` there, and gives them back in a frame of its own after its last
    event (the commitment is what a V4 reservation waits for, not the free blocks)."""

    def __init__(self, name="decode-0", capacity=8, never_fits=False, groups=None) -> None:
        super().__init__(name, "decode")
        self.capacity, self.never_fits = capacity, never_fits
        self.reserved: dict[str, object] = {}
        self.error_after_admit: str | None = None
        self.groups = None if groups is None else dict(groups)  # uncommitted per group
        self.committed: set[str] = set()
        self._tasks: set[asyncio.Future] = set()  # group releases under way

    def free_blocks(self) -> int:
        return self.capacity - len(self.reserved)

    def group_free(self) -> dict[str, int] | None:
        return None if self.groups is None else dict(self.groups)

    def _commit(self, request_id: str, sign: int) -> None:
        """Take (1) or give back (-1) ``request_id``'s V4 group blocks."""
        for name, n in V4_NEED.items():
            self.groups[name] -= sign * n
        (self.committed.add if sign > 0 else self.committed.discard)(request_id)

    def _release_groups(self, request_id: str) -> None:
        """V4: the request's group blocks go back, reported in a frame of their own (after
        ``hold("release_groups")``, when held)."""
        if self.groups is None or request_id not in self.committed:
            return

        async def release() -> None:
            await self._enter("release_groups")
            self._commit(request_id, -1)
            self.flush()
        task = asyncio.ensure_future(release())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reserve(self, spec, prefill_tp=1, prefill_cp=1):
        self.calls.append(("reserve", spec.request_id))
        await self._enter("reserve")
        if self.never_fits:
            return Rejection(spec.request_id, "needs 999 blocks, instance has 8: shorten it",
                             retryable=False)
        if len(self.reserved) >= self.capacity:
            return Rejection(spec.request_id, "no free blocks", retryable=True, blocks_needed=1)
        if self.groups is not None and any(self.groups[g] < n for g, n in V4_NEED.items()):
            return Rejection(spec.request_id, "DeepSeek-V4 blocks short", retryable=True,
                             blocks_needed=1, group_blocks_needed=tuple(V4_NEED.items()))
        if self.groups is not None:
            self._commit(spec.request_id, 1)
        self.reserved[spec.request_id] = spec
        return Reservation(spec.request_id, self.name, (0,), 16,
                           (KVPeer(self.name, 0, "127.0.0.1", 1),))

    async def admit(self, request_id: str, first_token_id: int) -> None:
        self.calls.append(("admit", request_id, first_token_id))
        await self._enter("admit")
        spec = self.reserved.get(request_id)
        if spec is None:  # aborted meanwhile (the real decode ignores it too)
            return
        if self.error_after_admit:
            self.emit(request_id, (), "error", error=self.error_after_admit)
            return
        toks = scripted(spec)
        assert toks[0] == first_token_id
        rest = toks[1:]
        for i in range(0, len(rest), 2):  # two tokens per event
            last = i + 2 >= len(rest)
            finish = ("stop" if rest[-1] == EOS and not spec.sampling.ignore_eos
                      else "length") if last else None
            if last:
                del self.reserved[request_id]  # NOTE: its last frame reports the block free
            self.emit(request_id, rest[i:i + 2], finish)
        self.reserved.pop(request_id, None)
        self._release_groups(request_id)

    def abort(self, request_id: str) -> bool:
        """Like the real decode: an abort that found the request says so with an event."""
        self.calls.append(("abort", request_id))
        found = self.reserved.pop(request_id, None) is not None
        if found:
            self.emit(request_id, (), "abort")
        else:
            self.flush()  # NOTE: a reservation freed silently
        self._release_groups(request_id)
        return found


class FakePrefill(_Leader):
    """Emits the first scripted token right after ``prefill`` (reporting ``cached_tokens``
    prompt tokens found in its prefix cache)."""

    def __init__(self, name="prefill-0") -> None:
        super().__init__(name, "prefill")
        self.specs: dict[str, object] = {}  # attempt id -> the spec it was asked to prefill
        self.aborted: set[str] = set()  # attempt ids aborted here (an Attach then says gone)
        self.cached_tokens = 0

    async def prefill(self, spec, reservation) -> None:
        """``reservation`` None (an eager launch): the token goes out all the same, as the
        real prefill computes before its Attach."""
        self.calls.append(("prefill", spec.request_id,
                           reservation.decode_instance if reservation else None))
        self.specs[spec.request_id] = spec
        await self._enter("prefill")
        first = scripted(spec)[0]
        done = "length" if spec.sampling.max_tokens == 1 else None
        self.emit(spec.request_id, (first,), done, source="prefill", cached=self.cached_tokens)
        await self._enter("prefill_answer")  # NOTE: the token is out, the call's answer held


    async def attach(self, request_id, reservation) -> bool:
        """False once aborted (as the real prefill, whose request is gone then)."""
        self.calls.append(("attach", request_id, reservation.decode_instance))
        await self._enter("attach")
        return request_id in self.specs and request_id not in self.aborted

    def abort(self, request_id: str) -> bool:
        self.calls.append(("abort", request_id))
        self.aborted.add(request_id)
        return request_id in self.specs


class FakeColocated(_Leader):
    def __init__(self, name="colocated-0") -> None:
        super().__init__(name, "colocated")
        self.report_finish = True  # False: never sets finish_reason, streams past max_tokens

    def generate(self, spec) -> None:
        self.calls.append(("generate", spec.request_id))
        toks = scripted(spec)
        if not self.report_finish:
            toks = toks + [5, 6]
        for i, tok in enumerate(toks):
            last = i == len(toks) - 1 and self.report_finish
            self.emit(spec.request_id, (tok,), "length" if last else None)
