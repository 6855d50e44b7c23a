"""Chaos (issue 9, "Must show"): a trace replay at a steady rate while ranks die and hang.

`orch up` (joined to the session Ray) with prefill dp 2 x tp 2 and decode dp 2 x tp 1.
Requests whose lengths come from the Mooncake conversation trace (capped to the tiny model's
context) are sent at a steady rate, each on its own thread, while one after the other:

1. decode-0's rank is killed (SIGKILL),
2. decode-0's rank is killed again, inside ``health.restart_window_s`` after its first restart
   with ``health.max_restarts: 1``: the restart budget is used up, so its restart waits until
   the window allows one (``orch status`` says so and when), then it comes back by itself,
3. prefill-0's leader is killed,
4. prefill-1's follower (rank 1) is killed,
5. decode-1's rank is stopped (SIGSTOP) for ``STOP_S`` seconds, then resumed (SIGCONT) (if
   orch has not killed it to restart its instance by then: the stop ends there),

each time waiting until every instance is healthy again. Checked:

- no request waits longer than ``MAX_EVENT_GAP_S`` for an event (its first response, each next
  one, or its end);
- the failed-request count is reported, and only requests that were on the faulted instance
  may fail: each failure names the instance faulted at that moment (requests with no first
  token yet are placed again, so a prefill fault fails nothing);
- each faulted instance serves again within ``RECOVER_WITHIN_S`` of its fault (the fault over
  the budget: within the rest of the window plus ``RECOVER_WITHIN_S``);
- afterwards no instance holds a block or a request (every block free, nothing in flight);
- after recovery, greedy outputs equal the colocated baseline (the engine run alone on the
  same checkpoint, tests/e2e/baseline.py).

The replay runs until requests are served before the first fault, and between faults until a
request sent after the recovery is served (the healed system takes load again).

The figures it prints are in docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import grpc

from orchestrator.config.load import load_config
from orchestrator.api.rpc import orch_pb2, orch_pb2_grpc
from tests.e2e.baseline import engine_greedy
from tests.e2e.harness import REPO, OrchProcess, wait_idle

TRACE = "mooncake_conversation_trace.jsonl"  # in ../shared/data
PERIOD_S = 1.0  # one request a second
MAX_PROMPT, MAX_OUTPUT = 200, 96  # tokens; the trace's lengths are capped to these
MAX_EVENT_GAP_S = 30.0
RECOVER_WITHIN_S = 60.0
STOP_S = 10.0
# NOTE: health.restart_window_s: the second decode-0 fault falls inside it. Quiet, that fault
# comes ~5 s after the first restart began (its restart + one request served), ~15 s at load
# 18-39 (docs/reliability.md), but restarts took 30-33 s in one loaded CI run, so the window
# stays 40 s (the fault over the budget waits out the rest of it)
WINDOW_S = 40.0
OVERRIDES = {"prefill.dp": 2, "prefill.tp": 2, "decode.dp": 2, "decode.tp": 1,
             "cluster.cpus_per_rank": 0.25, "router.request_timeout_s": 60,
             "health.probe_interval_s": 0.5, "health.probe_timeout_s": 3.0,
             "health.max_restarts": 1, "health.restart_window_s": WINDOW_S,
             "health.restart_backoff_s": 2.0,
             "kv_transfer.connect_timeout_s": 10, "kv_transfer.payload_timeout_s": 10,
             "kv_transfer.completion_timeout_s": 30}
# (instance, rank, signal): the faults, in order
FAULTS = (("decode-0", 0, signal.SIGKILL), ("decode-0", 0, signal.SIGKILL),
          ("prefill-0", 0, signal.SIGKILL), ("prefill-1", 1, signal.SIGKILL),
          ("decode-1", 0, signal.SIGSTOP))


@dataclass
class Outcome:
    """One replayed request: when it was sent, when each response came, how it ended."""

    prompt: tuple[int, ...]
    max_tokens: int
    sent: float
    arrivals: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    details: str = ""
    ended: float = 0.0

    def max_gap(self) -> float:
        times = [self.sent, *self.arrivals, self.ended]
        return max(b - a for a, b in zip(times, times[1:]))


@dataclass
class Fault:
    instance: str
    start: float
    end: float = 0.0
    details: set[str] = field(default_factory=set)  # its `orch status` details meanwhile


Request = tuple[tuple[int, ...], int]  # (prompt token ids, max_tokens)


def trace_requests(path, n: int) -> list[Request]:
    """The first ``n`` requests of the trace: its input and output lengths capped at
    MAX_PROMPT / MAX_OUTPUT, token ids varied by position so no two share a prefix."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i == n:
                break
            row = json.loads(line)
            length = max(1, min(row["input_length"], MAX_PROMPT))
            prompt = tuple(10 + (i * 7 + j) % 1000 for j in range(length))
            out.append((prompt, max(1, min(row["output_length"], MAX_OUTPUT))))
    return out


def send(orch: OrchProcess, request: Request, out: list[Outcome]) -> None:
    prompt, max_tokens = request
    rec = Outcome(prompt, max_tokens, time.monotonic())
    out.append(rec)
    req = orch_pb2.GenerateRequest(sampling=orch_pb2.SamplingParams(max_tokens=max_tokens,
                                                                     ignore_eos=True))
    req.token_ids.ids.extend(prompt)
    with grpc.insecure_channel(orch.address) as channel:
        try:
            for resp in orch_pb2_grpc.OrchStub(channel).Generate(req, timeout=180):
                rec.arrivals.append(time.monotonic())
                rec.tokens.extend(resp.token_ids)
        except grpc.RpcError as err:
            rec.code, rec.details = err.code(), err.details() or ""
    rec.ended = time.monotonic()


def replay(orch: OrchProcess, requests: list[Request], stop: threading.Event,
           out: list[Outcome]) -> None:
    """One request every PERIOD_S seconds (each on its own thread) until ``stop``."""
    for request in requests:
        if stop.wait(PERIOD_S):
            return
        threading.Thread(target=send, args=(orch, request, out), daemon=True).start()


def healthy(orch: OrchProcess) -> set[str]:
    return {row.name for row in orch.status().instances if row.health == "healthy"}


def rank_pid(orch: OrchProcess, instance: str, rank: int) -> int | None:
    """The rank's process id, None while its instance has no status (not healthy)."""
    (row,) = [i for i in orch.status().instances if i.name == instance]
    return next((r.pid for r in row.ranks if r.rank == rank), None)


def _exists(pid: int) -> bool:
    """Whether process ``pid`` still exists (Ray's raylet, not this process, reaps ranks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def fault_and_recover(orch: OrchProcess, instance: str, rank: int,
                      sig: signal.Signals, within_s: float = RECOVER_WITHIN_S) -> Fault:
    """Send ``sig`` to the rank; return once orch replaced it and every instance is healthy
    again (SIGSTOP: the process is resumed after STOP_S, if orch has not killed it by then),
    at most ``within_s`` after the fault."""
    everyone = healthy(orch)
    pid = rank_pid(orch, instance, rank)
    assert pid, f"{instance} rank {rank} has no pid in GetStatus"
    fault = Fault(instance, time.monotonic())
    os.kill(pid, sig)
    if sig == signal.SIGSTOP:
        # NOTE: the length of the stop is the fault itself; it ends early when orch killed the
        # process to restart the instance (detected hung after probe_timeout_s)
        while time.monotonic() - fault.start < STOP_S and _exists(pid):
            time.sleep(0.1)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # orch killed it to restart the instance
    while time.monotonic() - fault.start < within_s:
        # NOTE: back in service = every instance healthy, the faulted rank a new process
        if healthy(orch) == everyone and rank_pid(orch, instance, rank) not in (pid, None):
            fault.end = time.monotonic()
            return fault
        fault.details |= {row.detail for row in orch.status().instances
                          if row.name == instance and row.detail}
        time.sleep(0.25)
    raise AssertionError(f"{instance} is not serving again within {within_s} s of "
                         f"{sig.name} to its rank {rank} (pid {pid}); healthy: "
                         f"{sorted(healthy(orch))}\n{orch.log.read_text()[-3000:]}")


def wait_served(out: list[Outcome], since: float, count: int) -> None:
    """Returns once ``count`` requests sent at or after ``since`` (monotonic s) have their
    first response; fails after MAX_EVENT_GAP_S + PERIOD_S * count."""
    timeout_s = MAX_EVENT_GAP_S + PERIOD_S * count
    deadline = time.monotonic() + timeout_s
    while sum(1 for r in list(out) if r.sent >= since and r.arrivals) < count:
        assert time.monotonic() < deadline, \
            f"{count} requests sent since {since:.1f} not served within {timeout_s} s"
        time.sleep(0.1)


def test_chaos_faults_stay_small_and_heal(tmp_path, shared_data, joined_ray):
    requests = trace_requests(shared_data(TRACE), 600)
    out: list[Outcome] = []
    faults: list[Fault] = []
    with OrchProcess(REPO / "configs" / "1p1d.yaml", tmp_path,
                     {**OVERRIDES, **joined_ray}) as orch:
        stop = threading.Event()
        replayer = threading.Thread(target=replay, args=(orch, requests, stop, out),
                                    daemon=True)
        replayer.start()
        wait_served(out, 0.0, 3)  # NOTE: steady load before the first fault
        for instance, rank, sig in FAULTS:
            again = any(f.instance == instance for f in faults)
            faults.append(fault_and_recover(orch, instance, rank, sig,
                                            RECOVER_WITHIN_S + (WINDOW_S if again else 0)))
            wait_served(out, faults[-1].end, 1)  # NOTE: the healed system takes load
        deferred = " ".join(faults[1].details)
        assert "restart budget used up" in deferred and "next restart try in" in deferred, \
            faults[1].details
        checkpoint = load_config(orch.config).model.checkpoint_dir()
        stop.set()
        replayer.join(10)
        deadline = time.monotonic() + 120
        while any(r.ended == 0.0 for r in out) and time.monotonic() < deadline:
            time.sleep(0.5)
        wait_idle(orch, timeout_s=60)
        probes = requests[:4]
        after: list[Outcome] = []
        senders = [threading.Thread(target=send, args=(orch, p, after)) for p in probes]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(timeout=180)  # NOTE: send's own deadline is 180 s
        wait_idle(orch, timeout_s=60)
    failed = [r for r in out if r.code is not None]
    print(f"chaos: {len(out)} requests, {len(failed)} failed "
          f"({sorted({r.code.name for r in failed})}); back in service after "
          f"{[f'{f.instance} {f.end - f.start:.1f} s' for f in faults]}; longest wait for an "
          f"event {max(r.max_gap() for r in out):.1f} s")
    assert all(r.ended for r in out), "a request never ended"
    assert max(r.max_gap() for r in out) < MAX_EVENT_GAP_S
    for r in failed:  # only requests on the faulted instance, at that moment, may fail
        during = [f.instance for f in faults if r.sent <= f.end and f.start <= r.ended]
        assert any(name in r.details for name in during), (r.code, r.details, during)
    assert all(r.code is None for r in after), [(r.code, r.details) for r in after]
    colocated = engine_greedy(checkpoint, [p for p, _ in probes], [n for _, n in probes],
                              chunk=None)
    assert {r.prompt: r.tokens for r in after} == dict(zip([p for p, _ in probes], colocated))
