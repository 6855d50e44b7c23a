"""Wire a Router, its health monitor and status board from the config and the leader handles
(Ray actors or fakes)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Awaitable, Callable

from orchestrator.router.admission import AdmissionQueue
from orchestrator.config.checkpoint import ModelInfo
from orchestrator.config.load import serves_v4
from orchestrator.config.schema import OrchConfig
from orchestrator.router.detokenizer import Tokenizer
from orchestrator.router.flow import ColocatedFlow, Flow
from orchestrator.router.pd_flow import DisaggregatedFlow
from orchestrator.deploy.health import HealthMonitor, RestartWait
from orchestrator.router.kv_index import KVIndex
from orchestrator.router.leader import LeaderClient
from orchestrator.router.policies import make_policy
from orchestrator.router.reports import InstanceReports
from orchestrator.router.metrics_sink import RouterMetrics
from orchestrator.router.router import Router
from orchestrator.status import StatusBoard

log = logging.getLogger(__name__)
Healthy = Callable[[str], bool]
RECOVER_GRACE_S = 30.0  # beyond health.recover_timeout_s before the monitor gives up


def attaches_late(cfg: OrchConfig) -> bool:
    """Whether the prefill instances of ``cfg`` compute before their decode reservation
    (DisaggregatedFlow's eager launch): ``router.eager_prefill``, and not where the KV to
    ship is made by the step itself (DeepSeek-V4's staged rows, MTP's hidden state,
    context-parallel pieces), as ``PrefillRole.attaches_late`` says on the instance."""
    return cfg.router.eager_prefill and cfg.prefill.cp == 1 \
        and not cfg.decode.num_speculative_tokens and not serves_v4(cfg)


def leader_client(cfg: OrchConfig, name: str, role: str, handle: Any) -> LeaderClient:
    """The router's client of instance ``name``'s leader ``handle``: calls bounded by
    ``router.request_timeout_s``, sent over ``router.leader_calls``."""
    return LeaderClient(name, role, handle, call_timeout_s=cfg.router.request_timeout_s,
                        calls=cfg.router.leader_calls)


def build_flow(cfg: OrchConfig, handles: dict[str, Any], healthy: Healthy) -> Flow:
    """The flow of ``cfg.mode`` over leader ``handles`` (instance name -> leader handle);
    its policies choose only among instances for which ``healthy(name)`` holds.

    Raises:
        KeyError: a configured instance has no handle.
    """
    leaders = {inst.role: [] for inst in cfg.instances()}
    for inst in cfg.instances():
        leaders[inst.role].append(leader_client(cfg, inst.name, inst.role, handles[inst.name]))
    index = KVIndex() if cfg.router.policy == "kv_aware" else None

    def policy(role: str):
        return make_policy(cfg.router.policy, [l.name for l in leaders[role]], healthy, index)

    if cfg.mode == "colocated":
        flow: Flow = ColocatedFlow(leaders["colocated"], policy("colocated"))
    else:
        flow = DisaggregatedFlow(
            leaders["prefill"], leaders["decode"], policy("prefill"), policy("decode"),
            AdmissionQueue(cfg.router.max_pending), prefill_tp=cfg.prefill.tp,
            prefill_cp=cfg.prefill.cp, eager=attaches_late(cfg),
            reserve_late=attaches_late(cfg) and cfg.router.reserve_after_first_token)
    flow.kv_index = index
    return flow


def build_router(cfg: OrchConfig, handles: dict[str, Any], model: ModelInfo,
                 tokenizer: Tokenizer | None, metrics: RouterMetrics | None = None,
                 health: HealthMonitor | None = None, replica: int = 0,
                 reports: InstanceReports | None = None) -> Router:
    """A router over ``handles`` configured by ``cfg.router`` (call from the event loop);
    ``health``: its policies choose only instances the monitor says are healthy, and its
    placements wait while it restarts every instance of a role (None: all healthy, always);
    ``replica``: its index among ``router.replicas``; ``reports``: where the leaders' own
    reports go (:func:`build_reports`; None: none asked for)."""
    healthy = health.is_healthy if health is not None else (lambda name: True)
    return Router(build_flow(cfg, handles, healthy), model, tokenizer,
                  cfg.router.request_timeout_s, metrics=metrics,
                  max_attempts=cfg.router.max_attempts,
                  max_migrations=cfg.router.max_migrations, health=health, replica=replica,
                  reports=reports)


def build_reports(cfg: OrchConfig) -> InstanceReports:
    """The leaders' reports a router asks for: a heartbeat twice per ``health.probe_interval_s``
    (so a live instance is always heard within one interval and never pinged), a status each
    second (the status board's refresh)."""
    return InstanceReports(beat_s=cfg.health.probe_interval_s / 2)


def build_monitor(cfg: OrchConfig, ranks_of: Callable[[str], list[Any]],
                  on_unhealthy: Callable[[str, str], None] | None = None,
                  recover: Callable[[str], Awaitable[bool]] | None = None,
                  restart_wait: RestartWait | None = None,
                  reports: InstanceReports | None = None) -> HealthMonitor:
    """A health monitor of every instance of ``cfg``, timed by ``cfg.health`` (see
    :class:`HealthMonitor` for ``ranks_of``, ``on_unhealthy``, ``recover``, ``restart_wait``,
    ``reports``)."""
    h = cfg.health
    # NOTE: the Recoverer bounds a restart by recover_timeout_s itself and then gives up on
    # it a few seconds later; the monitor's own bound only catches a recover that hangs.
    return HealthMonitor({inst.name: inst.role for inst in cfg.instances()}, ranks_of,
                         h.probe_interval_s, h.probe_timeout_s, on_unhealthy=on_unhealthy,
                         recover=recover, recover_timeout_s=h.recover_timeout_s + RECOVER_GRACE_S,
                         backoff_s=h.restart_backoff_s, backoff_max_s=h.restart_backoff_max_s,
                         restart_wait=restart_wait, reports=reports)


def build_board(cfg: OrchConfig, router: Router, monitor: HealthMonitor) -> StatusBoard:
    """The status rows of ``router``'s instances (its metrics get every status answer; its
    1 s refresh reads the leaders' reports that ``router``'s streams bring; each row carries
    the load ``router``'s policies placed on the instance)."""
    return StatusBoard(lambda: router.flow.leaders,
                       {inst.role: inst.parallel.tp for inst in cfg.instances()}, monitor,
                       router.metrics, cfg.health.status_timeout_s, router.pump.reports,
                       pools=lambda: router.flow.pools)


def build_http_server(cfg: OrchConfig, router: Router, checkpoint: Path, token: str | None,
                      ready: Callable[[], bool], grace_s: float,
                      retry_after: Callable[[], float] = lambda: 1.0, reuse_port: bool = False):
    """The OpenAI HTTP API over ``router`` on ``router.host:router.http_port`` (TLS from
    ``router.tls``); ``ready`` drives its /health, ``retry_after`` its 503s' Retry-After.
    Chat uses the checkpoint's chat template; without one, chat completions answer 400 and a
    warning says why. ``reuse_port``: share the port with the other router replicas."""
    from orchestrator.api.http.app import OpenAIApp  # lazy: only when router.http_port is set
    from orchestrator.api.http.chat_template import ChatTemplate, ChatTemplateError
    from orchestrator.api.http.server import HttpServer

    try:
        template = ChatTemplate.from_checkpoint(checkpoint)
    except ChatTemplateError as exc:
        log.warning("/v1/chat/completions is off: %s", exc)
        template = None
    app = OpenAIApp(router, template, token, ready, retry_after)
    return HttpServer(app.asgi(), cfg.router.host, cfg.router.http_port, cfg.router.tls,
                      grace_s=grace_s, reuse_port=reuse_port)
