"""`orch bench` prints each leader's step time breakdown over the run: GetStatus before and
after the requests, the difference per instance (fake server; its counters grow per call)."""

from __future__ import annotations

from bench_fake_orch import FakeOrch, FakeServer
from orchestrator.bench.cli import main
from orchestrator.api.rpc import orch_pb2


class TimedFakeOrch(FakeOrch):
    """Says 10 more decode steps of 10 ms (8 ms forward, 1 ms sample) at every GetStatus."""

    def __init__(self) -> None:
        super().__init__(ttft_s=0.0, itl_s=0.0)
        self.calls = 0

    async def GetStatus(self, request, context):
        self.calls += 1
        n = 10 * self.calls
        phases = [orch_pb2.StepPhase(phase=p, count=n, total_s=n * s)
                  for p, s in (("step", 0.010), ("forward", 0.008), ("sample", 0.001))]
        inst = orch_pb2.InstanceStatus(name="decode-0", role="decode", tp=1, health="healthy",
                                       has_load=True, step_phases=phases)
        return orch_pb2.GetStatusResponse(instances=[inst])


def test_bench_prints_the_leaders_breakdown_over_the_run(capsys):
    fake = TimedFakeOrch()
    with FakeServer(fake) as server:
        rc = main(["--address", server.address, "--workload", "synthetic", "--num-requests",
                   "2", "--warmup", "0", "--input-len", "8", "--output-len", "2",
                   "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    # calls (connect's token check is a GetStatus too): check + before (20 steps), the run's
    # check, check + after (50 steps): 30 steps in the run
    assert fake.calls == 5
    assert ("decode-0: 30 steps, 10.00 ms/step: forward 8.00, sample 1.00, other 1.00 ms; "
            "outside forward 20.0%") in out


class SpecFakeOrch(TimedFakeOrch):
    """As TimedFakeOrch, and its decode instance speculates (MTP)."""

    async def GetStatus(self, request, context):
        resp = await super().GetStatus(request, context)
        resp.instances[0].spec_acceptance_rate = 0.8
        resp.instances[0].spec_mean_accepted_length = 1.8
        return resp


def test_bench_prints_mtp_acceptance_of_a_speculating_instance(capsys):
    with FakeServer(SpecFakeOrch()) as server:
        rc = main(["--address", server.address, "--workload", "synthetic", "--num-requests",
                   "2", "--warmup", "0", "--input-len", "8", "--output-len", "2",
                   "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "decode-0: MTP acceptance 0.80, 1.80 tokens per verify step (since start)" in out
