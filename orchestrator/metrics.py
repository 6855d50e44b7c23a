"""Prometheus metrics of the router: request latencies, outcomes, instance load, KV transfers.

Every :class:`RouterMetrics` owns its own ``CollectorRegistry``, so several routers (or tests)
in one process never clash, and serves it on its own HTTP endpoint (``start_http``/``stop``).

Names follow Prometheus conventions: ``orch_`` prefix, base units in the name (seconds, bytes),
``_total`` on counters. Exposed series:

- ``orch_ttft_seconds``, ``orch_tpot_seconds``, ``orch_e2e_seconds``: histograms (router
  clock: accepted -> first token; mean per output token after the first; accepted -> end).
- ``orch_ttft_phase_seconds{phase}``: histogram of each phase of the way to the first token
  (``RequestState.first_token_phases``: tokenize, placement, transport, the leader's queue,
  forward, step_other, sample, flush, then reserve_wait and router_out), one observation per
  phase per request.
- ``orch_requests_total{outcome}``: finished requests by outcome ("stop", "length", "abort",
  "error"); ``orch_rejected_total{code}``: requests refused before running, by gRPC code.
- ``orch_prompt_tokens_total``, ``orch_generation_tokens_total``.
- per instance, from the latest ``update_instances`` snapshot (instances absent from it
  disappear): gauges ``orch_instance_queue_depth``, ``orch_instance_running``,
  ``orch_instance_free_blocks``, ``orch_instance_total_blocks``,
  ``orch_instance_outstanding_tokens``, ``orch_instance_cached_blocks``,
  ``orch_instance_prefix_hit_rate``, ``orch_instance_spec_acceptance_rate``,
  ``orch_instance_spec_mean_accepted_length`` (MTP speculative decoding),
  ``orch_instance_info{instance,role,tp}`` (= 1), and
  counters ``orch_instance_kv_sent_bytes_total``, ``orch_instance_kv_failures_total`` (the
  instance's own cumulative totals; a restart that resets them reads as a counter reset).
- per instance leader step breakdown (rank/step_timing.py), from the same snapshot:
  summary ``orch_step_phase_seconds{instance,phase}`` (count and sum of each phase's records
  since the instance started; phase "step" is the whole loop iteration that ran a forward)
  and gauge ``orch_step_outside_forward_ratio{instance}`` ((step - forward) / step).
- per instance health (``track_health``): gauge ``orch_instance_healthy{instance,role}`` (1
  healthy, 0 unhealthy or recovering) and counter
  ``orch_health_transitions_total{instance,state}`` (changes into ``state``; ``recovering``
  counts automatic restarts, ``unhealthy`` failures seen); per role gauges
  ``orch_role_healthy_instances{role}`` and ``orch_role_instances{role}`` (fewer healthy than
  instances: reduced capacity; 0 healthy: the role cannot serve).
- per decode instance, from the same snapshot: summary ``orch_kv_tail_seconds{instance}``
  (count and sum of the requests' ``kv_tail_s``: end of the prefill forward of the last chunk
  -> decode holds every cell) and gauge ``orch_kv_tail_max_seconds{instance}``.
- per DeepSeek-V4 instance, from the same snapshot: gauge
  ``orch_kv_group_blocks{instance,group,state}`` (free and total blocks of each KV group's
  pool: window, entries/<kind>, state/<kind>).
- per instance, from the router's own policies at scrape time (``track_router_load``): gauge
  ``orch_router_outstanding_tokens{pool,instance}`` (tokens this router placed there and
  not yet released; with ``router.replicas`` > 1 each replica knows only its own placements,
  and this endpoint is the first replica's).
- per KV pair (``observe_transfer``): ``orch_kv_transfer_bytes_total{pair}``,
  ``orch_kv_transfer_seconds{pair}`` (histogram of successful transfers),
  ``orch_kv_transfer_failures_total{pair}``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from rank.messages import InstanceStatusInfo, TransferRecord
from orchestrator.deploy.health import Health, HealthMonitor, InstanceHealth

# NOTE: buckets span tiny CPU runs (ms) and production (TTFT ~24 s at 64K prompts, minutes
# under overload; TPOT ~26 ms on A3, seconds on a CPU).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TRANSFER_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_INSTANCE_GAUGES = (
    ("queue_depth", "requests waiting in the instance's queue"),
    ("running", "requests in the instance's running batch"),
    ("free_blocks", "free KV cache blocks"),
    ("total_blocks", "KV cache blocks in the pool"),
    ("outstanding_tokens", "tokens the instance still has to process (prompt + output)"),
    ("cached_blocks", "KV blocks findable in the instance's prefix cache"),
    ("prefix_hit_rate", "prompt tokens found in the prefix cache / looked up, since start"),
    ("spec_acceptance_rate", "MTP drafts kept / drafts made since start (0: no drafts)"),
    ("spec_mean_accepted_length", "tokens emitted per MTP verify step (1 + kept drafts)"),
)


class _InstanceCollector(Collector):
    """Exposes the latest instance snapshot; replaced whole, read by the HTTP thread."""

    def __init__(self) -> None:
        self.snapshot: tuple[InstanceStatusInfo, ...] = ()

    def collect(self) -> Iterable:
        snap = self.snapshot  # NOTE: one read; update_instances swaps the tuple atomically.
        for field, doc in _INSTANCE_GAUGES:
            fam = GaugeMetricFamily(f"orch_instance_{field}", doc, labels=["instance"])
            for s in snap:
                fam.add_metric([s.name], float(getattr(s, field)))
            yield fam
        info = GaugeMetricFamily("orch_instance_info", "instance role and TP size (always 1)",
                                 labels=["instance", "role", "tp"])
        sent = CounterMetricFamily("orch_instance_kv_sent_bytes",
                                   "KV cache bytes the instance has sent", labels=["instance"])
        fails = CounterMetricFamily("orch_instance_kv_failures",
                                    "KV transfers of the instance that failed",
                                    labels=["instance"])
        for s in snap:
            info.add_metric([s.name, s.role, str(s.tp)], 1.0)
            sent.add_metric([s.name], float(s.kv_bytes_sent))
            fails.add_metric([s.name], float(s.kv_failures))
        yield from (info, sent, fails)
        yield from _step_families(snap)
        yield from _kv_tail_families(snap)
        yield _kv_group_family(snap)


def _kv_group_family(snap: tuple[InstanceStatusInfo, ...]) -> GaugeMetricFamily:
    """``orch_kv_group_blocks{instance,group,state}`` of the DeepSeek-V4 instances of
    ``snap`` (``InstanceStatusInfo.kv_groups``; state "free" or "total")."""
    fam = GaugeMetricFamily("orch_kv_group_blocks", "blocks of each DeepSeek-V4 KV group's "
                            "pool (window, entries/<kind>, state/<kind>), free or total",
                            labels=["instance", "group", "state"])
    for s in snap:
        for group, free, total in s.kv_groups:
            fam.add_metric([s.name, group, "free"], float(free))
            fam.add_metric([s.name, group, "total"], float(total))
    return fam


class _RouterLoadCollector(Collector):
    """``orch_router_outstanding_tokens{pool,instance}``, read from the router's policies at
    scrape time (``pools()``: role -> policy with an ``outstanding`` dict, instance -> tokens;
    ``orchestrator.router.flow.Flow.pools``)."""

    def __init__(self, pools: Callable[[], Mapping[str, Any]]) -> None:
        self.pools = pools

    def collect(self) -> Iterable:
        fam = GaugeMetricFamily(
            "orch_router_outstanding_tokens", "tokens this router replica placed on the "
            "instance and not yet released (its policy's load: prefill, the prompts not "
            "finished; decode and colocated, prompt + max_tokens of each request held; "
            "kv_aware charges only the tokens an instance computes). With router.replicas > 1 "
            "each replica knows only its own placements: this is the first replica's (the one "
            "serving /metrics), not the deployment's sum", labels=["pool", "instance"])
        for pool, tokens in router_load(self.pools()):
            for name, n in tokens.items():
                fam.add_metric([pool, name], float(n))
        yield fam


def router_load(pools: Mapping[str, Any]) -> list[tuple[str, dict[str, int]]]:
    """(pool, {instance: outstanding tokens}) of each policy in ``pools`` (role -> policy),
    copied for a reader on another thread than the router's loop.

    NOTE: ``dict(d)`` of a plain dict copies it in one C call under the GIL, so the loop
    cannot add or remove an instance (live scaling) in the middle of a copy."""
    return [(pool, dict(policy.outstanding)) for pool, policy in list(pools.items())]


def _kv_tail_families(snap: tuple[InstanceStatusInfo, ...]) -> Iterable:
    """``orch_kv_tail_seconds`` and ``orch_kv_tail_max_seconds`` of the decode instances of
    ``snap`` (:class:`rank.messages.KVTailStats`)."""
    tail = SummaryMetricFamily("orch_kv_tail_seconds", "KV still in flight after the prefill "
                               "forward: end of the forward of a request's last chunk -> "
                               "decode holds every cell, seconds", labels=["instance"])
    worst = GaugeMetricFamily("orch_kv_tail_max_seconds", "longest kv_tail_seconds of the "
                              "instance so far", labels=["instance"])
    for s in snap:
        if s.role == "decode":
            tail.add_metric([s.name], count_value=s.kv_tail.count, sum_value=s.kv_tail.sum_s)
            worst.add_metric([s.name], s.kv_tail.max_s)
    yield from (tail, worst)


def _step_families(snap: tuple[InstanceStatusInfo, ...]) -> Iterable:
    """``orch_step_phase_seconds`` and ``orch_step_outside_forward_ratio`` of ``snap``."""
    phases = SummaryMetricFamily("orch_step_phase_seconds", "leader step time by phase "
                                 "(schedule, fanout, forward, follower_wait, after_step, "
                                 "sample, emit; step: the whole step), seconds",
                                 labels=["instance", "phase"])
    outside = GaugeMetricFamily("orch_step_outside_forward_ratio", "share of the leader's "
                                "step time spent outside the model forward",
                                labels=["instance"])
    for s in snap:
        t = s.step_timings
        for name, rec in (("step", t.step), *sorted(t.phases.items())):
            phases.add_metric([s.name, name], count_value=rec.count, sum_value=rec.total_s)
        outside.add_metric([s.name], t.outside_forward_fraction)
    yield from (phases, outside)


class RouterMetrics:
    """The router's metrics on a private registry. Methods are thread-safe (prometheus_client
    metrics lock internally) and cheap enough to call once per request.

    Args:
        host, port: when ``port`` is given, serve at once (same as calling :meth:`start_http`);
            the bound port is then in :attr:`port`. Call :meth:`stop` at shutdown.
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("orch_ttft_seconds", "time to first token, seconds",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("orch_tpot_seconds", "mean time per output token after the "
                              "first, seconds", buckets=TPOT_BUCKETS, registry=r)
        self.ttft_phase = Histogram("orch_ttft_phase_seconds", "time to first token by phase "
                                    "(tokenize, placement, transport, queue, forward, "
                                    "step_other, sample, flush, reserve_wait, router_out), "
                                    "seconds",
                                    ["phase"], buckets=TRANSFER_BUCKETS, registry=r)
        self.e2e = Histogram("orch_e2e_seconds", "request latency, accepted to finished, "
                             "seconds", buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("orch_requests", "finished requests by outcome",
                                ["outcome"], registry=r)
        self.rejected = Counter("orch_rejected", "requests refused before running, by gRPC "
                                "status code", ["code"], registry=r)
        self.migrations = Counter("orch_migrations", "requests moved to another instance "
                                  "after tokens streamed (docs/scaling.md)", registry=r)
        self.autoscale = Counter("orch_autoscale_decisions", "autoscaler steps by role, "
                                 "direction (+1 / -1) and kind (waiting, tpot, ttft, idle)",
                                 ["role", "direction", "kind"], registry=r)
        self.autoscale_prediction = Gauge("orch_autoscale_predicted_seconds", "the planner's "
                                          "TTFT / TPOT of the P:D the autoscaler's last step "
                                          "went to (docs/scaling.md)", ["measure"], registry=r)
        self.prompt_tokens = Counter("orch_prompt_tokens", "prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("orch_generation_tokens", "generated tokens of "
                                         "finished requests", registry=r)
        self.kv_bytes = Counter("orch_kv_transfer_bytes", "KV cache bytes moved per pair",
                                ["pair"], registry=r)
        self.kv_seconds = Histogram("orch_kv_transfer_seconds", "duration of successful KV "
                                    "transfers per pair, seconds", ["pair"],
                                    buckets=TRANSFER_BUCKETS, registry=r)
        self.kv_failures = Counter("orch_kv_transfer_failures", "failed KV transfers per pair",
                                   ["pair"], registry=r)
        self.healthy = Gauge("orch_instance_healthy", "1 while the instance is healthy (the "
                             "router sends it requests), else 0", ["instance", "role"],
                             registry=r)
        self.health_transitions = Counter("orch_health_transitions", "instance health "
                                          "changes, by the state entered", ["instance", "state"],
                                          registry=r)
        self.role_healthy = Gauge("orch_role_healthy_instances", "healthy instances of the "
                                  "role (below orch_role_instances: reduced capacity)",
                                  ["role"], registry=r)
        self.role_instances = Gauge("orch_role_instances", "instances of the role",
                                    ["role"], registry=r)
        self._monitor: HealthMonitor | None = None
        self._instances = _InstanceCollector()
        r.register(self._instances)
        self._httpd = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        if port is not None:
            self.start_http(host, port)

    def request_finished(self, outcome: str, ttft_s: float | None, tpot_s: float | None,
                         e2e_s: float, prompt_tokens: int, completion_tokens: int) -> None:
        """Record one finished request (any outcome); None latencies are not observed."""
        self.requests.labels(outcome=outcome).inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)

    def first_token(self, phases: tuple[tuple[str, float], ...]) -> None:
        """Record one request's way to its first token, (phase, seconds) in order (a
        negative duration, clocks of two processes disagreeing, counts as 0)."""
        for phase, seconds in phases:
            self.ttft_phase.labels(phase=phase).observe(max(0.0, seconds))

    def request_rejected(self, code: str) -> None:
        """Record a request refused before it ran; ``code`` is the gRPC status name."""
        self.rejected.labels(code=code).inc()

    def autoscale_decided(self, role: str, delta: int, kind: str) -> None:
        """Record one autoscaler step (docs/scaling.md)."""
        self.autoscale.labels(role=role, direction=f"{delta:+d}", kind=kind).inc()

    def autoscale_predicted(self, ttft_s: float, tpot_s: float) -> None:
        """The planner's TTFT / TPOT (seconds) of the P:D of the last autoscaler step."""
        self.autoscale_prediction.labels(measure="ttft").set(ttft_s)
        self.autoscale_prediction.labels(measure="tpot").set(tpot_s)

    def request_migrated(self) -> None:
        """Record one migration: a request placed again with its streamed tokens."""
        self.migrations.inc()

    def update_instances(self, statuses: list[InstanceStatusInfo]) -> None:
        """Replace the per-instance snapshot (call after each status poll) and observe the
        per-pair KV transfer records the statuses carry (each status carries its records once)."""
        self._instances.snapshot = tuple(statuses)
        for status in statuses:
            for record in status.transfers:
                self.observe_transfer(record)

    def track_router_load(self, pools: Callable[[], Mapping[str, Any]]) -> None:
        """Expose ``orch_router_outstanding_tokens`` from ``pools()`` (role -> policy, the
        router's ``flow.pools``), read at each scrape; call once (a second call would
        expose the series twice)."""
        self.registry.register(_RouterLoadCollector(pools))

    def track_health(self, monitor: HealthMonitor) -> None:
        """Follow ``monitor``: the gauge from its
        current snapshot now, the gauge and the transition counter at every change."""
        self._monitor = monitor
        for health in monitor.snapshot():
            self._set_healthy(health)
        monitor.add_listener(self.health_changed)

    def health_changed(self, health: InstanceHealth) -> None:
        """One instance changed state (a ``HealthMonitor`` listener)."""
        self._set_healthy(health)
        self.health_transitions.labels(instance=health.name, state=health.state.value).inc()

    def _set_healthy(self, health: InstanceHealth) -> None:
        if self._monitor is not None and health.name not in {
                h.name for h in self._monitor.snapshot()}:  # NOTE: removed (`orch scale`)
            self.healthy.remove(health.name, health.role)
        else:
            self.healthy.labels(instance=health.name, role=health.role).set(
                1.0 if health.state is Health.HEALTHY else 0.0)
        for role, (healthy, total) in (self._monitor.capacity() if self._monitor else {}).items():
            self.role_healthy.labels(role=role).set(healthy)
            self.role_instances.labels(role=role).set(total)

    def observe_transfer(self, record: TransferRecord) -> None:
        """Record one KV transfer on its pair (e.g. ``"prefill-0:0->decode-0:1"``): bytes and
        duration when ``ok``, a failure otherwise (its bytes are not counted as moved)."""
        if record.ok:
            self.kv_bytes.labels(pair=record.pair).inc(record.nbytes)
            self.kv_seconds.labels(pair=record.pair).observe(record.seconds)
        else:
            self.kv_failures.labels(pair=record.pair).inc()

    def start_http(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the bound port.

        Raises:
            RuntimeError: already serving; call :meth:`stop` first.
            OSError: the port is taken (pass another, or 0 for a free one).
        """
        from prometheus_client import start_http_server

        if self._httpd is not None:
            raise RuntimeError("metrics endpoint already running; call stop() first")
        self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._httpd.server_port
        return self.port

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the HTTP endpoint and join its thread (bounded by ``timeout_s``); idempotent."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout_s)
        self._httpd, self._thread, self.port = None, None, None
