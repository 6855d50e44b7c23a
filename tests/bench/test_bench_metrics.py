"""RouterMetrics: values scraped over HTTP from 127.0.0.1, private registries, clean stop."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rank.messages import InstanceStatusInfo, TransferRecord
from orchestrator.metrics import RouterMetrics


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _feed(m: RouterMetrics) -> None:
    m.request_finished("length", ttft_s=0.08, tpot_s=0.02, e2e_s=1.5, prompt_tokens=100,
                       completion_tokens=20)
    m.request_finished("length", ttft_s=30.0, tpot_s=0.2, e2e_s=90.0, prompt_tokens=50,
                       completion_tokens=10)
    m.request_finished("abort", ttft_s=None, tpot_s=None, e2e_s=0.5, prompt_tokens=7,
                       completion_tokens=0)
    m.request_rejected("RESOURCE_EXHAUSTED")
    m.request_rejected("RESOURCE_EXHAUSTED")
    m.request_rejected("INVALID_ARGUMENT")
    m.observe_transfer(TransferRecord("prefill-0:0->decode-0:0", 4096, 0.003, ok=True))
    m.observe_transfer(TransferRecord("prefill-0:0->decode-0:0", 1024, 0.2, ok=True))
    m.observe_transfer(TransferRecord("prefill-0:0->decode-0:0", 999, 1.0, ok=False))


def test_scraped_values_match_calls():
    threads_before = set(threading.enumerate())
    m = RouterMetrics()
    port = m.start_http()
    try:
        _feed(m)
        m.update_instances([
            InstanceStatusInfo("prefill-0", "prefill", 1, queue_depth=2, running=1,
                               free_blocks=90, total_blocks=128, outstanding_tokens=5000,
                               kv_bytes_sent=123456, kv_failures=2),
            InstanceStatusInfo("decode-0", "decode", 2, running=3, free_blocks=10,
                               total_blocks=64, outstanding_tokens=300)])
        got = _scrape(port)
    finally:
        m.stop()
    assert got[("orch_requests_total", (("outcome", "length"),))] == 2
    assert got[("orch_requests_total", (("outcome", "abort"),))] == 1
    assert got[("orch_rejected_total", (("code", "RESOURCE_EXHAUSTED"),))] == 2
    assert got[("orch_rejected_total", (("code", "INVALID_ARGUMENT"),))] == 1
    assert got[("orch_prompt_tokens_total", ())] == 157
    assert got[("orch_generation_tokens_total", ())] == 30
    assert got[("orch_ttft_seconds_count", ())] == 2  # the abort had no first token
    assert got[("orch_ttft_seconds_sum", ())] == pytest.approx(30.08)
    assert got[("orch_ttft_seconds_bucket", (("le", "0.05"),))] == 0
    assert got[("orch_ttft_seconds_bucket", (("le", "0.1"),))] == 1
    assert got[("orch_ttft_seconds_bucket", (("le", "30.0"),))] == 2
    assert got[("orch_tpot_seconds_bucket", (("le", "0.02"),))] == 1
    assert got[("orch_e2e_seconds_count", ())] == 3
    assert got[("orch_e2e_seconds_bucket", (("le", "60.0"),))] == 2
    assert got[("orch_e2e_seconds_bucket", (("le", "120.0"),))] == 3
    pair = (("pair", "prefill-0:0->decode-0:0"),)
    assert got[("orch_kv_transfer_bytes_total", pair)] == 5120
    assert got[("orch_kv_transfer_failures_total", pair)] == 1
    assert got[("orch_kv_transfer_seconds_count", pair)] == 2
    assert got[("orch_kv_transfer_seconds_bucket", (("le", "0.005"),) + pair)] == 1
    p0, d0 = (("instance", "prefill-0"),), (("instance", "decode-0"),)
    assert got[("orch_instance_queue_depth", p0)] == 2
    assert got[("orch_instance_running", d0)] == 3
    assert got[("orch_instance_free_blocks", p0)] == 90
    assert got[("orch_instance_total_blocks", d0)] == 64
    assert got[("orch_instance_outstanding_tokens", p0)] == 5000
    assert got[("orch_instance_kv_sent_bytes_total", p0)] == 123456
    assert got[("orch_instance_kv_failures_total", p0)] == 2
    assert got[("orch_instance_info", (("instance", "decode-0"), ("role", "decode"),
                                       ("tp", "2")))] == 1
    # NOTE: no thread of the metrics server is left (another test's thread may have ended
    # meanwhile: only new ones count)
    assert not set(threading.enumerate()) - threads_before
    with pytest.raises(urllib.error.URLError):
        _scrape(port)


def test_snapshot_replaces_instances_and_registries_are_private():
    a, b = RouterMetrics(), RouterMetrics()
    a.update_instances([InstanceStatusInfo("decode-0", "decode", 1, queue_depth=4)])
    a.update_instances([InstanceStatusInfo("decode-1", "decode", 1, queue_depth=1)])
    a.request_rejected("UNAVAILABLE")
    pa, pb = a.start_http(), b.start_http()
    try:
        with pytest.raises(RuntimeError, match="stop"):
            a.start_http()
        got_a, got_b = _scrape(pa), _scrape(pb)
    finally:
        a.stop()
        b.stop()
    b.stop()  # idempotent
    assert ("orch_instance_queue_depth", (("instance", "decode-0"),)) not in got_a
    assert got_a[("orch_instance_queue_depth", (("instance", "decode-1"),))] == 1
    assert got_a[("orch_rejected_total", (("code", "UNAVAILABLE"),))] == 1
    assert not any(name == "orch_rejected_total" for name, _ in got_b)
    assert not any(name == "orch_instance_queue_depth" for name, _ in got_b)


def test_constructor_with_port_serves_at_once():
    m = RouterMetrics("127.0.0.1", 0)
    try:
        assert m.port and _scrape(m.port) is not None
        m.request_rejected("UNAVAILABLE")
        assert _scrape(m.port)[("orch_rejected_total", (("code", "UNAVAILABLE"),))] == 1
    finally:
        m.stop()
    assert m.port is None
