"""Placement while the only prefill instance is being restarted, through a real grpc.aio
server over fake leaders and the real health monitor: the request waits for it (no attempt
spent) and completes, also one that got its decode reservation after waiting for decode room
(it keeps the reservation); one that cannot come back fails UNAVAILABLE, naming why, within the
deadline; an abort or a shutdown ends the wait at once; a reservation held meanwhile is freed
once."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from orchestrator.api.client import OrchClient
from orchestrator.deploy.health import Health
from tests.orchestrator.fakes import FakePrefill, Remote, expected_tokens
from tests.orchestrator.harness import Harness
from tests.orchestrator.test_router import _calls, _wait_for

PROMPT = (4, 5, 6)
RESTART_S = 1.0


def _restart_after(delay_s: float, ok: bool = True):
    """A recover callback: after ``delay_s`` the instance has new (fake) actors, rebound to
    its leader client, or (``ok`` False) the restart failed."""
    async def recover(h: Harness, name: str) -> bool:
        await asyncio.sleep(delay_s)
        if ok:
            h.fakes[name] = fresh = FakePrefill(name)
            h.handles[name] = Remote(fresh)
            h.router.flow.leader(name).rebind(h.handles[name])
        return ok
    return recover


def _state(h: Harness, name: str) -> Health:
    return h.call_in_loop(lambda: h.monitor.get(name).state)


def _fail_prefill(h: Harness) -> None:
    h.call_in_loop(lambda: h.monitor.report_failure("prefill-0", "rank 0 is gone"))


def _stream_in_thread(client: OrchClient, request_id: str, max_tokens: int = 4):
    result: dict = {}

    def run():
        try:
            result["chunks"] = list(client.generate(token_ids=list(PROMPT),
                                                    request_id=request_id,
                                                    max_tokens=max_tokens))
        except grpc.RpcError as err:
            result["error"] = err
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _waiting_for_the_restart(h: Harness, client: OrchClient, request_id: str):
    """The only prefill failed and ``request_id`` is streaming, past tokenizing: waiting for
    the instance to come back. Returns (its stream thread, result)."""
    _fail_prefill(h)
    thread, result = _stream_in_thread(client, request_id)
    assert _wait_for(lambda: h.call_in_loop(lambda: h.router.in_flight) == 1)
    time.sleep(0.2)  # NOTE: past tokenizing: waiting for the instance
    return thread, result


@pytest.fixture
def restarting():
    h = Harness(recover=_restart_after(RESTART_S))
    yield h
    h.close()


def test_a_request_waits_for_the_only_prefill_being_restarted(restarting):
    h = restarting
    _fail_prefill(h)
    assert _state(h, "prefill-0") is Health.RECOVERING
    start = time.monotonic()
    with OrchClient(h.address) as client:
        chunks = list(client.generate(token_ids=list(PROMPT), request_id="w", max_tokens=4))
    assert time.monotonic() - start >= RESTART_S * 0.8  # it waited for the restart
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 4)
    assert _calls(h, "prefill-0") == [("prefill", "w@1", "decode-0")]  # one attempt
    assert [c[1] for c in _calls(h, "decode-0") if c[0] == "reserve"] == ["w@1"]
    assert h.metrics.finished == [("length", len(PROMPT), 4)]


def test_a_retry_waits_for_the_restart_instead_of_failing(restarting):
    """The prefill dies under a launched request: its retry waits for the restart."""
    h = restarting
    entered, release = h.call_in_loop(lambda: h.fakes["prefill-0"].hold("prefill"))
    old = h.fakes["prefill-0"]
    with OrchClient(h.address) as client:
        thread, result = _stream_in_thread(client, "r")
        h.run(entered.wait())
        _fail_prefill(h)  # -> router.fleet.instance_failed: attempt 1 fails
        thread.join(RESTART_S + 5)
        assert not thread.is_alive()
    assert "error" not in result, result["error"].details()
    chunks = result["chunks"]
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 4)
    assert _calls(h, "prefill-0") == [("prefill", "r@2", "decode-0")]  # the new actors
    assert ("abort", "r@1") in _calls(h, "decode-0")
    h.call_in_loop(release.set)
    assert old.calls[0] == ("prefill", "r@1", "decode-0")


def test_a_retry_after_a_kill_the_monitor_missed_waits_for_the_restart():
    """Issue 25: the killed prefill fails the request's poll at once; the monitor's next
    probe is far off, so the retry's placement still sees it healthy: it is probed, found
    dead, restarted, and the retry runs on the new one (not max_attempts spent at once)."""
    h = Harness(recover=_restart_after(RESTART_S), probe_interval_s=60.0)
    try:
        entered, release = h.call_in_loop(lambda: h.fakes["prefill-0"].hold("prefill"))
        with OrchClient(h.address) as client:
            thread, result = _stream_in_thread(client, "k")
            h.run(entered.wait())
            h.call_in_loop(lambda: h.fakes["prefill-0"].die())
            thread.join(RESTART_S + 5)
            assert not thread.is_alive()
        assert "error" not in result, result["error"].details()
        tokens = [t for c in result["chunks"] for t in c.token_ids]
        assert tokens == expected_tokens(PROMPT, 4)
        assert _calls(h, "prefill-0") == [("prefill", "k@2", "decode-0")]  # the new actors
        assert [c[1] for c in _calls(h, "decode-0") if c[0] == "reserve"] == ["k@1", "k@2"]
        assert _state(h, "prefill-0") is Health.HEALTHY
        h.call_in_loop(release.set)
    finally:
        h.close()


def _queued_then_granted_during_a_restart(h: Harness, request_id: str):
    """``request_id`` waits in the admission queue (decode full), the only prefill fails, then
    decode reports room: the request reserves while the prefill is being restarted. Returns
    (its stream thread, result, client); the caller closes the client."""
    decode, queue = h.fakes["decode-0"], h.router.flow.admission
    h.call_in_loop(lambda: setattr(decode, "capacity", 0))
    client = OrchClient(h.address)
    thread, result = _stream_in_thread(client, request_id)
    assert _wait_for(lambda: h.call_in_loop(lambda: queue.waiting) == 1)
    _fail_prefill(h)
    assert _state(h, "prefill-0") is not Health.HEALTHY

    def room() -> None:
        decode.capacity = 1
        decode.flush()
    h.call_in_loop(room)
    # NOTE: granted and reserved, it leaves the queue (a stale frame may grant a refused try
    # first: it keeps its place, admission.py)
    assert _wait_for(lambda: h.call_in_loop(lambda: queue.waiting) == 0)
    return thread, result, client


def _reserves(h: Harness) -> list[str]:
    return [c[1] for c in _calls(h, "decode-0") if c[0] == "reserve"]


def test_a_request_granted_decode_room_while_the_prefill_restarts_waits_for_it():
    """Newcomer bug: a request that waited for decode blocks and got them while the only
    prefill was being restarted failed UNAVAILABLE at once ("no healthy prefill instance");
    it keeps its reservation, waits for the restart and completes."""
    h = Harness(recover=_restart_after(RESTART_S), max_pending=8, request_timeout_s=20.0)
    try:
        start = time.monotonic()
        thread, result, client = _queued_then_granted_during_a_restart(h, "q")
        with client:
            thread.join(RESTART_S + 5)
            assert not thread.is_alive()
        assert "error" not in result, result["error"].details()
        assert time.monotonic() - start >= RESTART_S * 0.8  # it waited for the restart
        tokens = [t for c in result["chunks"] for t in c.token_ids]
        assert tokens == expected_tokens(PROMPT, 4)
        assert _calls(h, "prefill-0") == [("prefill", "q@1", "decode-0")]  # the new actors
        assert set(_reserves(h)) == {"q@1"}  # one attempt, its reservation kept
        decode = h.fakes["decode-0"]
        assert h.call_in_loop(lambda: (dict(decode.reserved), [c for c in decode.calls
                                                               if c[0] == "abort"])) == ({}, [])
        assert h.metrics.finished == [("length", len(PROMPT), 4)]
    finally:
        h.close()


def test_abort_while_holding_a_reservation_for_a_restart_frees_it_once():
    h = Harness(recover=_restart_after(60.0), max_pending=8, request_timeout_s=30.0)
    try:
        thread, result, client = _queued_then_granted_during_a_restart(h, "a")
        with client:
            time.sleep(0.2)  # NOTE: waiting for the prefill, holding its reservation
            assert thread.is_alive()
            assert client.abort("a") is True
            thread.join(3)
            assert not thread.is_alive()
        assert "error" not in result, result["error"].details()
        (last,) = result["chunks"]
        assert last.finish_reason == "abort" and last.token_ids == ()
        decode = h.fakes["decode-0"]
        assert _wait_for(lambda: ("abort", "a@1") in _calls(h, "decode-0"))
        time.sleep(0.1)
        assert _calls(h, "decode-0").count(("abort", "a@1")) == 1
        assert h.call_in_loop(lambda: dict(decode.reserved)) == {}
        assert _calls(h, "prefill-0") == []
    finally:
        h.close()


def test_a_reservation_held_for_a_restart_past_the_deadline_is_freed_once():
    h = Harness(recover=_restart_after(60.0), max_pending=8, request_timeout_s=2.0)
    try:
        start = time.monotonic()
        thread, result, client = _queued_then_granted_during_a_restart(h, "d")
        with client:
            thread.join(5)
            assert not thread.is_alive()
        assert 1.5 <= time.monotonic() - start < 5.0  # at the deadline, not at once
        err = result["error"]
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy prefill instance within router.request_timeout_s" in err.details()
        assert _calls(h, "decode-0").count(("abort", "d@1")) == 1
        assert h.call_in_loop(lambda: dict(h.fakes["decode-0"].reserved)) == {}
    finally:
        h.close()


def test_a_failing_restart_is_retried_and_the_request_waits_to_its_deadline_naming_why():
    """A failed restart is tried again after a backoff (health.restart_backoff_s) shorter
    than the request's deadline: the instance is still coming back, so the request waits,
    then ends UNAVAILABLE at its deadline naming the failed restart."""
    h = Harness(recover=_restart_after(0.3, ok=False), request_timeout_s=2.0,
                restart_backoff_s=0.2)
    try:
        _fail_prefill(h)
        start = time.monotonic()
        with OrchClient(h.address) as client:
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate(token_ids=list(PROMPT), max_tokens=2))
        assert 1.5 <= time.monotonic() - start < 6.0  # at the deadline, not at once
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        details = err.value.details()
        # NOTE: at the deadline, or one backoff before it once the next try falls after it
        assert "no healthy prefill instance within router.request_timeout_s: still being " \
            "restarted" in details or "no restart of one is due before" in details, details
        assert "the automatic restart failed" in details, details
        assert _calls(h, "decode-0") == []  # nothing was reserved
    finally:
        h.close()


def test_a_restart_try_due_after_the_deadline_is_unavailable_at_once():
    """The failed restart's next try (health.restart_backoff_s = 5 s, as when the restart
    budget is used up) comes after the request's deadline: nothing can serve it in time, so it
    ends UNAVAILABLE at once instead of waiting router.request_timeout_s."""
    h = Harness(recover=_restart_after(0.3, ok=False), request_timeout_s=3.0)
    try:
        _fail_prefill(h)
        start = time.monotonic()
        with OrchClient(h.address) as client:
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate(token_ids=list(PROMPT), max_tokens=2))
        assert time.monotonic() - start < 1.5  # the failed try came at 0.3 s
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no restart of one is due before this request's deadline" in \
            err.value.details(), err.value.details()
        assert "next restart try in 5 s" in err.value.details(), err.value.details()
        assert _calls(h, "decode-0") == []  # nothing was reserved
    finally:
        h.close()


def test_a_restart_past_the_deadline_is_unavailable_at_the_deadline():
    h = Harness(recover=_restart_after(60.0), request_timeout_s=1.0)
    try:
        _fail_prefill(h)
        start = time.monotonic()
        with OrchClient(h.address) as client:
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate(token_ids=list(PROMPT), max_tokens=2))
        assert 0.8 <= time.monotonic() - start < 5.0
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy prefill instance within router.request_timeout_s" in \
            err.value.details()
        assert "prefill-0: restarting after: rank 0 is gone" in err.value.details()
        assert h.metrics.rejected == ["UNAVAILABLE"]
    finally:
        h.close()


def test_without_recovery_an_unhealthy_prefill_fails_fast():
    h = Harness()  # no recover: the instance stays unhealthy
    try:
        _fail_prefill(h)
        start = time.monotonic()
        with OrchClient(h.address) as client:
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate(token_ids=list(PROMPT), max_tokens=2))
        assert time.monotonic() - start < 2.0
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "automatic recovery is off" in err.value.details()
    finally:
        h.close()


def test_abort_while_waiting_for_a_restart_ends_it_at_once():
    h = Harness(recover=_restart_after(60.0), request_timeout_s=30.0)
    try:
        with OrchClient(h.address) as client:
            thread, result = _waiting_for_the_restart(h, client, "a")
            assert client.abort("a") is True
            thread.join(3)
            assert not thread.is_alive()
        (last,) = result["chunks"]
        assert last.finish_reason == "abort" and last.token_ids == ()
        assert h.metrics.finished == [("abort", len(PROMPT), 0)]
        assert _calls(h, "decode-0") == []
    finally:
        h.close()


def test_shutdown_ends_a_request_waiting_for_a_restart_unavailable():
    h = Harness(recover=_restart_after(60.0), request_timeout_s=30.0)
    try:
        with OrchClient(h.address) as client:
            thread, result = _waiting_for_the_restart(h, client, "s")
            start = time.monotonic()
            h.run(h.router.stop(drain_timeout_s=10.0))
            assert time.monotonic() - start < 3.0  # not the 10 s drain
            thread.join(3)
            assert not thread.is_alive()
        assert result["error"].code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down before an instance came back" in result["error"].details()
    finally:
        h.close()
