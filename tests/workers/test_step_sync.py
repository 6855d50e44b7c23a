"""The leader's runner releases reach every rank with the step (rank/spmd.py ``StepSync``):
the leader takes them before the fan-out and frees them before its own forward; a follower
frees them before its forward and runs the step with the role's own inputs; a step with
nothing released keeps its plain frame; a leader whose loop is idle has every rank free them at
once, each once.  Stub ranks: the V4 runner side (take / free by
request id) is tests/workers/test_v4_pd_tp.py's."""

from __future__ import annotations

from types import SimpleNamespace

from rank import spmd
from rank.rank import Rank
from rank.spmd import SPMDGroup, StepSync
from rank.step_timing import StepTimer


class StubRank:
    """Records the order of the calls a step makes on a rank."""

    def __init__(self, released: tuple[str, ...] = ()) -> None:
        self.calls: list[tuple] = []
        self._released = released

    def take_releases(self) -> tuple[str, ...]:
        out, self._released = self._released, ()
        self.calls.append(("take", out))
        return out

    def free_released(self, released: tuple[str, ...]) -> None:
        self.calls.append(("free", released))

    def forward(self, steps, step_inputs=None):
        self.calls.append(("forward", steps, step_inputs))
        return "logits"

    def after_step(self, step_inputs, output=None) -> None:
        self.calls.append(("after_step", step_inputs, output))


class StubChannel:
    def __init__(self) -> None:
        self.frames: list = []

    def run(self, steps, step_inputs, deadline, bound_s) -> None:
        self.frames.append((steps, step_inputs))

    def wait(self, deadline, bound_s) -> None:
        pass


def test_leader_ships_its_releases_with_the_step_and_frees_them_first():
    leader, channel = StubRank(("a", "b")), StubChannel()
    group = SPMDGroup(leader, [leader, object()], channel, StepTimer(), 5.0)
    assert group.run_step(["s1"], "inputs") == "logits"
    assert channel.frames == [(["s1"], StepSync("inputs", ("a", "b")))]
    assert [c[0] for c in leader.calls] == ["take", "free", "forward", "after_step"]
    assert leader.calls[1] == ("free", ("a", "b"))
    assert leader.calls[2] == ("forward", ["s1"], "inputs")
    group.run_step(["s2"], "more")  # NOTE: nothing released since: the plain frame
    assert channel.frames[-1] == (["s2"], "more")


def test_follower_frees_before_its_step_and_runs_it_with_the_roles_inputs():
    follower = StubRank()
    Rank.execute_step(follower, ["s1"], StepSync("inputs", ("a",)))
    Rank.execute_step(follower, ["s2"], "plain")
    assert follower.calls == [("free", ("a",)), ("forward", ["s1"], "inputs"),
                              ("after_step", "inputs", "logits"),
                              ("forward", ["s2"], "plain"), ("after_step", "plain", "logits")]


def test_an_idle_leader_has_every_rank_free_its_releases_once(monkeypatch):
    """No step comes to carry them (the instance is idle): the leader takes its releases once,
    each follower frees them by an actor call and the leader itself; a later idle iteration or
    step carries none of them again."""
    freed: list[tuple[str, ...]] = []
    follower = SimpleNamespace(free_released=SimpleNamespace(
        remote=lambda released: freed.append(released) or f"ref{len(freed)}"))
    waited: list[list] = []
    monkeypatch.setattr(spmd, "await_followers",
                        lambda refs, left_s, bound_s, what: waited.append(refs) or [None])
    leader, channel = StubRank(("a", "b")), StubChannel()
    group = SPMDGroup(leader, [leader, follower], channel, StepTimer(), 5.0)
    group.free_released()
    assert freed == [("a", "b")] and waited == [["ref1"]]
    assert leader.calls == [("take", ("a", "b")), ("free", ("a", "b"))]
    group.free_released()  # NOTE: nothing released since: no call
    assert freed == [("a", "b")] and waited == [["ref1"]]
    group.run_step(["s"], "inputs")
    assert channel.frames == [(["s"], "inputs")]  # the plain frame: freed once
