"""The leader loop's idle wait: 5 ms while requests are on the instance or it steps in DP
lockstep, else parked up to PARK_S but never past the next heartbeat frame; a parked loop
still wakes at once for new work; the event stream says when its heartbeat is due."""

from __future__ import annotations

import threading
import time

import pytest

from rank import loop as loop_mod
from rank.event_stream import EventStream
from rank.loop import IDLE_WAIT_S, PARK_S, StepLoop


class FakeStream:
    def __init__(self, due: float | None = None) -> None:
        self.due = due

    def beat_due_in(self) -> float | None:
        return self.due


class FakeLeader:
    def __init__(self, due: float | None = None, lockstep: bool = False) -> None:
        self.wake, self.broken = threading.Event(), None
        self.stream, self.in_lockstep = FakeStream(due), lockstep
        self.step_timer = type("T", (), {"end_step": lambda self, s: None})()

    def flush_events(self) -> None:
        pass

    def leave_lockstep(self) -> None:
        pass


class FakeRole:
    """Idle unless ``work`` holds a request; counts its steps."""

    def __init__(self, active: int = 0) -> None:
        self.active, self.steps, self.work = active, 0, []
        self.ran = threading.Event()

    def num_active(self) -> int:
        if self.active < 0:
            raise RuntimeError("broken count")
        return self.active

    def step(self) -> bool:
        self.steps += 1
        if self.work:
            self.work.pop()
            self.ran.set()
            return True
        return False

    def fail_all(self, error: str) -> None:
        pass


@pytest.mark.parametrize("active, lockstep, due, want", [
    (1, False, None, IDLE_WAIT_S),  # a request on the instance: poll
    (0, True, None, IDLE_WAIT_S),  # DP lockstep: meet every round
    (0, False, None, PARK_S),  # nothing, no heartbeat asked for: park
    (0, False, 1.0, PARK_S),
    (0, False, 0.02, 0.02),  # the heartbeat is due first
    (0, False, -3.0, IDLE_WAIT_S),  # overdue: the next flush sends it
    (-1, False, None, IDLE_WAIT_S),  # the count raised: poll, never end the loop
])
def test_idle_wait_bound(active, lockstep, due, want):
    loop = StepLoop("x", FakeLeader(due, lockstep), FakeRole(active))
    assert loop._idle_wait_s() == pytest.approx(want)


def test_a_parked_loop_ticks_rarely_and_wakes_for_work_at_once(monkeypatch):
    monkeypatch.setattr(loop_mod, "PARK_S", 30.0)  # NOTE: only the wake event can wake it
    leader, role = FakeLeader(), FakeRole()
    loop = StepLoop("x", leader, role)
    loop.start()
    try:
        time.sleep(0.3)
        assert role.steps == 1  # NOTE: polling every 5 ms would be ~60
        role.work.append("request")
        leader.wake.set()
        assert role.ran.wait(5.0)
    finally:
        loop.stop()
    assert not loop.is_alive()


def test_event_stream_says_when_its_heartbeat_is_due():
    stream = EventStream("x", "127.0.0.1")
    try:
        assert stream.beat_due_in() is None  # nobody subscribed
        stream.open("router-a")
        assert stream.beat_due_in() is None  # subscribed without a heartbeat
        stream.open("router-b", beat_s=30.0)
        assert stream.beat_due_in() <= 0  # never sent a frame: due now
        assert stream.flush(free_blocks=3)
        assert 29.0 < stream.beat_due_in() <= 30.0
    finally:
        stream.close()
