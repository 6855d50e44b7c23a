"""MTP acceptance numbers travel from an instance's status to `orch status` and /metrics."""

from __future__ import annotations

from prometheus_client import generate_latest

from orchestrator.api.convert import status_from_proto, status_to_proto
from orchestrator.cli import format_status
from orchestrator.metrics import RouterMetrics
from orchestrator.status import InstanceView
from rank.messages import InstanceStatusInfo


def _view(rate: float, mean_len: float) -> InstanceView:
    info = InstanceStatusInfo(name="decode-0", role="decode", tp=1, spec_acceptance_rate=rate,
                              spec_mean_accepted_length=mean_len)
    return InstanceView("decode-0", "decode", 1, "healthy", "", info)


def test_acceptance_travels_through_proto_and_shows_in_orch_status():
    (back,) = status_from_proto(status_to_proto([_view(0.75, 1.75)], 0, "tiny"))
    assert (back.status.spec_acceptance_rate, back.status.spec_mean_accepted_length) == \
        (0.75, 1.75)
    assert "MTP: acceptance 0.75, 1.75 tokens per verify step" in format_status([back])
    assert "MTP" not in format_status([_view(0.0, 0.0)])


def test_acceptance_is_a_metric():
    metrics = RouterMetrics()
    metrics.update_instances([_view(0.5, 1.5).status])
    text = generate_latest(metrics.registry).decode()
    assert 'orch_instance_spec_acceptance_rate{instance="decode-0"} 0.5' in text
    assert 'orch_instance_spec_mean_accepted_length{instance="decode-0"} 1.5' in text
