"""The step channel (rank/step_channel.py) in one process, no Ray, no model: a
leader end and follower ends on threads with scripted step functions. Steps and their inputs
arrive whole; a follower's error comes back as the same type and the follower keeps serving;
a dead follower is RankGone at once even while another hangs; a silent one is RankHung at
the deadline; closing leaves no thread behind."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from rank.failures import RankGone, RankHung
from rank.step_channel import StepChannelFollower, StepChannelLeader


class Script:
    """A follower's step function: records what it ran; raises or blocks on request."""

    def __init__(self) -> None:
        self.ran: list[tuple[list, object]] = []
        self.raise_next: Exception | None = None
        self.block = threading.Event()  # set: the next step waits until ``release`` is set
        self.release = threading.Event()

    def __call__(self, steps: list, step_inputs: object) -> None:
        if self.block.is_set():
            self.release.wait(10)
        self.ran.append((steps, step_inputs))
        if self.raise_next is not None:
            exc, self.raise_next = self.raise_next, None
            raise exc


@pytest.fixture
def channel():
    """A leader and two followers, connected; yields (leader, followers, scripts)."""
    leader = StepChannelLeader("127.0.0.1", 2)
    scripts = [Script(), Script()]
    followers = [StepChannelFollower(leader.address, leader.token, rank, scripts[rank - 1],
                                     f"test-{rank}-steps", 5.0) for rank in (1, 2)]
    leader.accept(5.0)
    yield leader, followers, scripts
    for s in scripts:
        s.release.set()
    for f in followers:
        f.close()
    leader.close()


def step(leader: StepChannelLeader, steps: list, inputs: object, bound_s: float = 5.0) -> None:
    deadline = time.monotonic() + bound_s
    leader.run(steps, inputs, deadline, bound_s)
    leader.wait(deadline, bound_s)


def test_steps_reach_every_follower_in_order(channel):
    leader, _, scripts = channel
    step(leader, ["a", 1], {"x": (1, 2)})
    step(leader, [], None)
    for s in scripts:
        assert s.ran == [(["a", 1], {"x": (1, 2)}), ([], None)]


def test_follower_error_is_reraised_with_its_type_and_the_follower_serves_on(channel):
    leader, followers, scripts = channel
    scripts[1].raise_next = ValueError("step refused: too many tokens")
    with pytest.raises(ValueError, match="step refused: too many tokens") as info:
        step(leader, ["b"], None)
    assert "rank 2" in "".join(info.value.__notes__)
    step(leader, ["c"], None)  # both acked again: the channel stayed in step
    assert [s.ran[-1] for s in scripts] == [(["c"], None), (["c"], None)]


def test_unpicklable_error_arrives_as_its_text(channel):
    leader, _, scripts = channel

    class Local(Exception):  # a local class: pickle cannot find it
        pass

    scripts[0].raise_next = Local("odd")
    with pytest.raises(RuntimeError, match="Local: odd"):
        step(leader, ["d"], None)


def _refuse_to_unpickle():
    raise ValueError("this step frame cannot be read here")


class Unreadable:
    """Pickles fine; unpickling it raises (a class a follower lacks, a corrupt frame)."""

    def __reduce__(self):
        return _refuse_to_unpickle, ()


def test_unreadable_step_frame_fails_the_step_at_once_and_the_channel_serves_on(channel):
    leader, _, scripts = channel
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="cannot be read here") as info:
        step(leader, ["f"], Unreadable(), bound_s=30.0)
    assert time.monotonic() - t0 < 5.0  # not the step's 30 s bound
    assert "rank 1" in "".join(info.value.__notes__)
    step(leader, ["g"], None)
    assert [s.ran for s in scripts] == [[(["g"], None)]] * 2


def test_dead_follower_is_gone_at_once_while_another_hangs(channel):
    leader, followers, scripts = channel
    scripts[0].block.set()  # rank 1 hangs in its step
    followers[1]._sock.close()  # rank 2's process died: its socket closes
    t0 = time.monotonic()
    with pytest.raises(RankGone, match="rank 2 is gone"):
        step(leader, ["e"], None, bound_s=5.0)
    assert time.monotonic() - t0 < 1.0


def test_silent_follower_is_hung_at_the_deadline(channel):
    leader, _, scripts = channel
    scripts[1].block.set()
    t0 = time.monotonic()
    with pytest.raises(RankHung, match=r"rank 2 did not finish a step within 0.3 s \(hung, or health.step_timeout_s"):
        step(leader, ["f"], None, bound_s=0.3)
    assert 0.25 < time.monotonic() - t0 < 2.0


def test_close_ends_follower_threads():
    leader = StepChannelLeader("127.0.0.1", 1)
    follower = StepChannelFollower(leader.address, leader.token, 1, Script(), "closing-1-steps",
                                   5.0)
    leader.accept(5.0)
    step(leader, ["g"], None)
    leader.close()  # the follower sees the end of its connection and stops
    follower._thread.join(5)
    assert not follower._thread.is_alive()
    follower.close()
    assert not [t for t in threading.enumerate() if t.name == "closing-1-steps"]


def test_accept_refuses_a_stranger_and_names_the_follower_that_never_came():
    leader = StepChannelLeader("127.0.0.1", 2)
    follower = StepChannelFollower(leader.address, leader.token, 1, Script(),
                                   "lonely-1-steps", 5.0)
    stranger = StepChannelFollower(leader.address, b"x" * 16, 2, Script(), "stranger-2-steps",
                                   5.0)  # does not know the token: refused, rank 2 missing
    try:
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[2\] did not connect"):
            leader.accept(0.3)
    finally:
        follower.close()
        stranger.close()
        leader.close()


def test_a_silent_stranger_does_not_stall_the_followers_accept():
    leader = StepChannelLeader("127.0.0.1", 2)
    stranger = socket.create_connection(leader.address, timeout=5.0)  # connects, says nothing
    half = socket.create_connection(leader.address, timeout=5.0)
    half.sendall(b"\x00\x00")  # a hello cut short
    followers = [StepChannelFollower(leader.address, leader.token, rank, Script(),
                                     f"after-stranger-{rank}-steps", 5.0) for rank in (1, 2)]
    try:
        t0 = time.monotonic()
        leader.accept(3.0)
        assert time.monotonic() - t0 < 1.0
        step(leader, ["h"], None)
    finally:
        for f in followers:
            f.close()
        stranger.close()
        half.close()
        leader.close()
