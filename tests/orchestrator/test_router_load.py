"""The router's own per-instance load (its policies' outstanding tokens) is visible from
outside: ``orch_router_outstanding_tokens{pool,instance}`` on /metrics and the ``routed``
column of `orch status`, while a request is placed and back to 0 once it ended."""

from __future__ import annotations

import threading
import time

from prometheus_client import generate_latest

from orchestrator import cli
from orchestrator.api.client import OrchClient
from orchestrator.metrics import RouterMetrics
from tests.orchestrator.harness import Harness

PROMPT, MAX_TOKENS = [3, 4, 5], 4


def _gauge(metrics: RouterMetrics, pool: str, instance: str) -> float | None:
    """The gauge's value for (pool, instance) as a scrape reads it; None when absent."""
    return metrics.registry.get_sample_value("orch_router_outstanding_tokens",
                                             {"pool": pool, "instance": instance})


def _wait(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_placed_load_shows_in_the_gauge_and_status_and_goes_back_to_zero():
    """A request held in prefill (its decode reservation made): prefill carries its prompt
    (3 tokens), decode prompt + max_tokens (7); both read 0 after it finished."""
    h = Harness()
    metrics = RouterMetrics()
    metrics.track_router_load(lambda: h.router.flow.pools)
    try:
        prefill = h.fakes["prefill-0"]
        entered, release = h.call_in_loop(lambda: prefill.hold("prefill"))
        assert (_gauge(metrics, "prefill", "prefill-0"), _gauge(metrics, "decode", "decode-0")) \
            == (0.0, 0.0)
        out: list = []

        def run() -> None:
            with OrchClient(h.address) as client:
                out.extend(client.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS,
                                           ignore_eos=True, timeout_s=20))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        h.run(entered.wait())
        assert _gauge(metrics, "prefill", "prefill-0") == len(PROMPT)
        assert _gauge(metrics, "decode", "decode-0") == len(PROMPT) + MAX_TOKENS
        text = generate_latest(metrics.registry).decode()
        assert 'orch_router_outstanding_tokens{instance="decode-0",pool="decode"} 7.0' in text
        with OrchClient(h.address) as client:
            views, _, _ = client.status()
        routed = {v.name: v.router_tokens for v in views}
        assert routed == {"prefill-0": len(PROMPT), "decode-0": len(PROMPT) + MAX_TOKENS}
        table = cli.format_status(views)
        assert "routed" in table.splitlines()[0]
        h.call_in_loop(release.set)
        thread.join(20)
        assert not thread.is_alive() and out[-1].finish_reason == "length"
        _wait(lambda: _gauge(metrics, "decode", "decode-0") == 0.0)
        assert _gauge(metrics, "prefill", "prefill-0") == 0.0
        with OrchClient(h.address) as client:
            views, _, _ = client.status()
        assert {v.name: v.router_tokens for v in views} == {"prefill-0": 0, "decode-0": 0}
    finally:
        h.close()
