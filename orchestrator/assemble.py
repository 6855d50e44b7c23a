"""Wire a Router from the config and the leader handles (Ray actors or fakes)."""

from __future__ import annotations

from typing import Any

from orchestrator.admission import AdmissionQueue
from orchestrator.checkpoint import ModelInfo
from orchestrator.config import OrchConfig
from orchestrator.detokenizer import Tokenizer
from orchestrator.flow import ColocatedFlow, DisaggregatedFlow, Flow
from orchestrator.leader import LeaderClient
from orchestrator.policies import make_policy
from orchestrator.router import Router, RouterMetrics


def build_flow(cfg: OrchConfig, handles: dict[str, Any]) -> Flow:
    """The flow of ``cfg.mode`` over leader ``handles`` (instance name -> leader handle).

    Raises:
        KeyError: a configured instance has no handle.
    """
    timeout = cfg.router.request_timeout_s
    leaders = {inst.role: [] for inst in cfg.instances()}
    for inst in cfg.instances():
        leaders[inst.role].append(LeaderClient(inst.name, inst.role, handles[inst.name],
                                               call_timeout_s=timeout))
    policy = cfg.router.policy
    if cfg.mode == "colocated":
        return ColocatedFlow(leaders["colocated"],
                             make_policy(policy, [l.name for l in leaders["colocated"]]))
    return DisaggregatedFlow(
        leaders["prefill"], leaders["decode"],
        make_policy(policy, [l.name for l in leaders["prefill"]]),
        make_policy(policy, [l.name for l in leaders["decode"]]),
        AdmissionQueue(cfg.router.max_pending), prefill_tp=cfg.prefill.tp)


def build_router(cfg: OrchConfig, handles: dict[str, Any], model: ModelInfo,
                 tokenizer: Tokenizer | None, metrics: RouterMetrics | None = None,
                 poll_timeout_s: float = 0.5) -> Router:
    """A router over ``handles`` configured by ``cfg.router`` (call from the event loop)."""
    return Router(build_flow(cfg, handles), model, tokenizer, cfg.router.request_timeout_s,
                  metrics=metrics, poll_timeout_s=poll_timeout_s,
                  max_attempts=cfg.router.max_attempts)
