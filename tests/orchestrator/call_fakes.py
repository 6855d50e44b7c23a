"""Fakes for the leader call tests (``router.leader_calls: socket``): a leader end that runs a
handler over Ray's path and over a real :class:`~rank.call_server.CallServer`, a Ray handle
whose errors are wrapped as Ray wraps them, and the handler they answer with."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from ray.exceptions import RayTaskError

from rank.call_server import CallServer
from rank.messages import Abort, InstanceOutOfService, Rejection
from tests.orchestrator.fakes import Remote

WAIT_S = 5.0  # every wait of these tests


class Leader:
    """A leader end: ``request`` runs ``handle`` (the Ray path), ``open_calls`` opens a real
    :class:`CallServer` around the same ``handle``."""

    def __init__(self, handle, name: str = "decode-0") -> None:
        self.handle, self.name = handle, name
        self.server = CallServer(name, "127.0.0.1", handle, threads=4)
        self.opens = 0

    def open_calls(self):
        self.opens += 1
        return self.server.open()

    def request(self, request):
        return self.handle(request)


class RayHandle(Remote):
    """Remote(leader) whose ``request`` fails as a Ray actor call does: the worker's exception
    inside a ``RayTaskError`` that is also an instance of it (``as_instanceof_cause``)."""

    def __getattr__(self, name):
        method = super().__getattr__(name)
        if name != "request":
            return method

        class _Method:
            @staticmethod
            def remote(*args):
                async def run():
                    try:
                        return await method.remote(*args)
                    except Exception as exc:
                        raise RayTaskError("request", "traceback", exc).as_instanceof_cause()
                return run()
        return _Method


class Unpicklable(RuntimeError):
    """An error whose pickle fails (it holds a lock): only its line can travel."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.lock = threading.Lock()


def answer(request):
    """A handler: an Abort answers whether the id starts with "r"; other requests raise what
    their id names."""
    if isinstance(request, Abort):
        rid = request.request_id
        if rid == "out":
            raise InstanceOutOfService("decode-0 is out of service: rank 1 is dead\n(detail)")
        if rid == "unpicklable":
            raise Unpicklable("a lock inside\nsecond line")
        if rid == "rejected":
            return Rejection(rid, "decode-0 is full (0 of 8 blocks free, 2 needed)",
                             blocks_needed=2)
        return rid.startswith("r")
    raise TypeError(f"decode-0 does not take {type(request).__name__}")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def threads_named(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def until(predicate, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def leader():
    leader = Leader(answer)
    yield leader
    leader.server.close()
    assert until(lambda: not threads_named("decode-0-calls")), threads_named("decode-0-calls")
