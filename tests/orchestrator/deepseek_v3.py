"""DeepSeek-V3 as the tests take it: its shipped config.json (:func:`v3`); its per-rank memory
on the A3 layout computed by hand (REFERENCE.md "Config"), the reference the memory plan's
tests hold (orchestrator/config/memory_plan.py) and the fit check's refusals quote
(orchestrator/config/memory_check.py); and the planner's decode step on DeepSeek's EP 144
decode layout (:func:`v3_decode`)."""

from __future__ import annotations

import json

from dataclasses import replace

from engine.model_config import ModelConfig
from orchestrator.config.devices import GB
from orchestrator.config.memory_plan import Precision, plan_role
from orchestrator.config.role_layout import RoleLayout
from orchestrator.planner.cost import decode_step_cost
from orchestrator.planner.hardware import Hardware
from orchestrator.planner.moe import StepOptions, experts_per_rank
from orchestrator.planner.specs import named_device
from orchestrator.planner.terms import Cost
from tests.e2e.harness import REPO

A3 = REPO / "configs" / "a3_p2x16_d8x4.yaml"
V3_JSON = REPO / "configs" / "models" / "deepseek-v3" / "config.json"

# DeepSeek-V3, by hand (REFERENCE.md "Config"): elements of one layer's tensors.
Q_A = 7168 * 1536                    # q_a_proj              11,010,048  whole
KV_A = 7168 * (512 + 64)             # kv_a_proj_with_mqa     4,128,768  whole
Q_B = 1536 * 128 * (128 + 64)        # q_b_proj              37,748,736  by heads
KV_B = 512 * 128 * (128 + 128)       # kv_b_proj             16,777,216  by heads
O = 128 * 128 * 7168                 # o_proj               117,440,512  by heads
DENSE = 3 * 7168 * 18432             # one dense MLP        396,361,728  (3 layers)
EXPERT = 3 * 7168 * 2048             # one expert            44,040,192  (58 MoE layers)
VOCAB = 129280 * 7168                # embedding = lm_head  926,679,040
NORMS = 2 * 7168 + 1536 + 512        # per layer: input/post norms, q_a and kv_a norms
GATE = 256 * 7168 + 256              # per MoE layer: router weight + correction bias
KV_TOKEN = (512 + 64) * 2 * 61       # bytes of one token's KV, bf16, 61 layers: 70,272


LINEAR_KINDS = ("attention", "dense MLP", "shared experts", "routed experts")


def hand_plan(tp: int, experts_per_rank: int | None, blocks: int, seqs: int,
              linear_bytes: float = 2) -> dict[str, float]:
    """GB per rank, bf16 (experts_per_rank None: all 256 experts split by tp); the linear
    weights (kv_b_proj excepted) at ``linear_bytes`` per element."""
    routed = 58 * (experts_per_rank * EXPERT if experts_per_rank else 256 * EXPERT / tp)
    weights = {
        "attention": 61 * (Q_A + KV_A + (Q_B + O) / tp),
        "attention: kv_b_proj": 61 * KV_B / tp,
        "dense MLP": 3 * DENSE / tp,
        "shared experts": 58 * EXPERT / tp,
        "routed experts": routed,
        "embedding": VOCAB / tp,
        "lm_head": VOCAB / tp,
        "norms + router gate": 61 * NORMS + 7168 + 58 * GATE,
    }
    plan = {kind: (linear_bytes if kind in LINEAR_KINDS else 2) * n / GB
            for kind, n in weights.items()}
    plan["kv"] = blocks * 128 * KV_TOKEN / GB
    plan["logits"] = seqs * 129280 * 4 / GB
    return plan


def hand_activations(tp: int, step_tokens: int, prefix_tokens: int) -> float:
    """GB of the workspace estimate under EP (docs/memory_plan.md), bf16."""
    heads = 128 // tp
    per_token = 4 * 7168 + 1536 + 512 + 64 + heads * 2 * (192 + 128) \
        + 8 * (2 * 7168 + 3 * 2048)  # 8 experts per token, each whole
    return 2 * (step_tokens * per_token + prefix_tokens * heads * (128 + 128)) / GB


def v3() -> ModelConfig:
    return ModelConfig.from_dict(json.loads(V3_JSON.read_text()))


def v3_decode(opts: StepOptions, batch: float, device: str = "h800") -> Cost:
    """One decode step of ``batch`` sequences at 4096 tokens of context on DeepSeek's decode
    layout (EP 144, 1-byte linears) on ``device``, under ``opts``."""
    m = v3()
    lay = RoleLayout("decode", 144, 1, True, 1, 128, 512, 512, 8192)
    prec = Precision(1, 2, 2, 2)
    # NOTE: EP 144 holds 256 experts plus redundant copies: the memory plan sees the slots
    plan = plan_role(replace(m, n_routed_experts=experts_per_rank(m, 144) * 144), lay, prec)
    return decode_step_cost(m, plan, prec, Hardware(named_device(device)), batch, 4096, opts)
