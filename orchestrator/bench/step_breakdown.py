"""The leaders' step time breakdown over an ``orch bench`` run, from ``GetStatus``.

Each leader keeps running sums per step phase (rank/step_timing.py); the bench reads
them before and after the timed requests and prints the difference: per instance, mean
milliseconds per step of each phase and the share of the step spent outside the model forward,
and, for instances that speculate (MTP), their acceptance rate and tokens per verify step
(since the instance started). Decode leaders keep the same kind of sums of ``kv_tail_s`` (:class:`rank.messages.KVTailStats`):
the run's mean goes into the report (:func:`kv_tail_of_run`).
"""

from __future__ import annotations

from orchestrator.bench.records import RunnerConfig
from orchestrator.bench.grpc_backend import connect
from orchestrator.api.client import bearer_metadata
from orchestrator.api.convert import status_from_proto
from orchestrator.api.rpc import orch_pb2, orch_pb2_grpc
from rank.messages import InstanceStatusInfo, KVTailStats
from rank.step_timing import StepTimings


async def read_statuses(cfg: RunnerConfig) -> dict[str, InstanceStatusInfo]:
    """instance name -> its leader's status now (instances without load are absent).

    Raises:
        ConnectionError: the router is not reachable within ``cfg.connect_timeout_s``.
        grpc.aio.AioRpcError: ``GetStatus`` failed.
    """
    channel = await connect(cfg.address, cfg.connect_timeout_s, cfg.tls_ca, cfg.token)
    try:
        resp = await orch_pb2_grpc.OrchStub(channel).GetStatus(
            orch_pb2.GetStatusRequest(), timeout=cfg.connect_timeout_s,
            metadata=bearer_metadata(cfg.token))
    finally:
        await channel.close()
    return {v.name: v.status for v in status_from_proto(resp) if v.status is not None}


def kv_tail_of_run(before: dict[str, InstanceStatusInfo],
                   after: dict[str, InstanceStatusInfo]) -> dict[str, dict]:
    """decode instance -> its ``kv_tail_s`` over the requests between ``before`` and
    ``after``: ``{"requests", "mean_ms", "max_ms"}`` (``max_ms``: since the instance
    started); instances that measured none are absent."""
    out = {}
    for name, s in after.items():
        old = before[name].kv_tail if name in before else KVTailStats()
        mean = s.kv_tail.mean_since(old)
        if mean is None and s.kv_tail.count and s.kv_tail.count < old.count:
            mean = s.kv_tail.mean_since(KVTailStats())  # NOTE: a restarted leader
            old = KVTailStats()
        if mean is not None:
            out[name] = {"requests": s.kv_tail.count - old.count, "mean_ms": mean * 1e3,
                         "max_ms": s.kv_tail.max_s * 1e3}
    return out


def print_step_breakdown(before: dict[str, InstanceStatusInfo],
                         after: dict[str, InstanceStatusInfo], console=None) -> None:
    """One line per instance: its steps between ``before`` and ``after``, plus a line of MTP
    acceptance for one that speculates (rich ``console``, default stdout)."""
    from rich.console import Console

    console = console or Console()
    console.print("step time per leader (ms per step; outside forward = 1 - forward/step):")
    for name in sorted(after):
        old = before.get(name)
        run = after[name].step_timings.since(old.step_timings if old else StepTimings())
        console.print(f"  {name}: {run.format()}", markup=False, highlight=False,
                      soft_wrap=True)
        if after[name].spec_mean_accepted_length:
            console.print(f"  {name}: MTP acceptance {after[name].spec_acceptance_rate:.2f}, "
                          f"{after[name].spec_mean_accepted_length:.2f} tokens per verify "
                          "step (since start)", markup=False, highlight=False)
