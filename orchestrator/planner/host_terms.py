"""The host terms of a step, s: the dispatch of its kernels, the leader's call that runs it
on its TP followers, the serving layer's cost per step, and the Ray calls on a request's way
to its first token. The figures are the device's (:class:`.specs.DeviceSpec`), measured on
cpu (:mod:`.calibrate`).
"""

from __future__ import annotations

from engine.model_config import ModelConfig
from orchestrator.config.role_layout import RoleLayout
from orchestrator.config.weight_rows import num_moe_layers
from orchestrator.planner.hardware import Hardware
from orchestrator.planner.terms import counts_for


def host_s(m: ModelConfig, lay: RoleLayout, hw: Hardware, tokens: float) -> float:
    """Host dispatch of one step of ``tokens`` tokens on one DP rank (with ``ep`` every DP
    rank's tokens reach the experts): per layer, plus per routed expert the rank runs."""
    c = counts_for(m)
    step_tokens = tokens * (lay.dp if lay.ep else 1)
    local = (m.n_routed_experts or 0) / lay.ep_size
    experts = num_moe_layers(m) * local * c.expert_active_share(m, step_tokens)
    return 1e-6 * (m.num_hidden_layers * hw.spec.layer_overhead_us
                   + experts * hw.spec.expert_overhead_us)


def step_call_s(lay: RoleLayout, hw: Hardware) -> float:
    """The leader's Ray call that runs a step on its TP followers (0 for tp 1)."""
    return hw.spec.control_call_us * 1e-6 if lay.tp > 1 else 0.0


def serving_s(hw: Hardware) -> float:
    """The serving layer's cost of one leader step beyond the engine's (scheduler, sampler,
    token events and the router's poll of them), s."""
    return hw.spec.step_serving_us * 1e-6


def router_call_us(spec, leader_calls: str) -> float:
    """One router -> leader call's round trip, us, over ``leader_calls`` (``router.leader_calls``:
    "ray" or "socket"; a device without a socket figure counts a Ray call)."""
    if leader_calls == "socket" and spec.socket_call_us > 0:
        return spec.socket_call_us
    return spec.control_call_us


def request_calls(colocated: bool) -> int:
    """Ray calls in turn on a request's way to its first token (docs/request_path.md):
    colocated, the launch; disaggregated, the decode reservation, the receivers it arms on
    the decode ranks (in parallel: one round trip) and the prefill launch."""
    return 1 if colocated else 3
