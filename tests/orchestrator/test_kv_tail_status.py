"""``kv_tail_s`` (issue 27) as the decode leader reports it: through GetStatus (proto), in
`orch status`, on /metrics and in an `orch bench` report's run figures."""

from __future__ import annotations

import pytest

from orchestrator.api.convert import status_from_proto, status_to_proto
from orchestrator.bench.step_breakdown import kv_tail_of_run
from orchestrator.cli import format_status
from orchestrator.metrics import RouterMetrics
from orchestrator.status import InstanceView
from rank.messages import InstanceStatusInfo, KVTailStats


def _tails(*seconds: float) -> KVTailStats:
    stats = KVTailStats()
    for s in seconds:
        stats = stats.add(s)
    return stats


def test_kv_tail_travels_through_get_status_and_shows_in_orch_status():
    status = InstanceStatusInfo("decode-0", "decode", 1, kv_tail=_tails(0.004, 0.001, 0.002))
    views = [InstanceView("decode-0", "decode", 1, "healthy", "", status),
             InstanceView("prefill-0", "prefill", 1, "healthy", "",
                          InstanceStatusInfo("prefill-0", "prefill", 1))]
    back = status_from_proto(status_to_proto(views, 0, "tiny"))
    assert back[0].status.kv_tail == KVTailStats(3, pytest.approx(0.007), 0.004, 0.002)
    text = format_status(back)
    assert ("kv_tail_s (prefill forward end -> every cell here): 3 requests, mean 2.33 ms, "
            "max 4.00 ms, last 2.00 ms") in text
    assert text.count("kv_tail_s") == 1  # nothing measured on the prefill row


def test_kv_tail_on_metrics():
    metrics = RouterMetrics()
    metrics.update_instances([InstanceStatusInfo("decode-0", "decode", 1,
                                                 kv_tail=_tails(0.003, 0.005))])
    value = metrics.registry.get_sample_value
    assert value("orch_kv_tail_seconds_count", {"instance": "decode-0"}) == 2
    assert value("orch_kv_tail_seconds_sum", {"instance": "decode-0"}) == pytest.approx(0.008)
    assert value("orch_kv_tail_max_seconds", {"instance": "decode-0"}) == pytest.approx(0.005)


def test_bench_run_figures_count_only_the_run():
    before = {"decode-0": InstanceStatusInfo("decode-0", "decode", 1, kv_tail=_tails(1.0))}
    after = {"decode-0": InstanceStatusInfo("decode-0", "decode", 1,
                                            kv_tail=_tails(1.0, 0.002, 0.004)),
             "prefill-0": InstanceStatusInfo("prefill-0", "prefill", 1)}
    assert kv_tail_of_run(before, after) == {
        "decode-0": {"requests": 2, "mean_ms": pytest.approx(3.0), "max_ms": 1000.0}}
    restarted = {"decode-0": InstanceStatusInfo("decode-0", "decode", 1, kv_tail=_tails(0.006))}
    assert kv_tail_of_run({"decode-0": after["decode-0"]}, restarted)["decode-0"][
        "mean_ms"] == pytest.approx(6.0)
