"""The planner held against published large-EP DeepSeek serving results (docs/planner.md,
"Validation"): ``python -m orchestrator.planner.validation [--explain] [--json] [--markdown]
[--row KEY]``.

Each :class:`Published` row is one published throughput with the layout and load its source
states; the prediction runs the same cost model as ``orch plan`` on that layout (DP attention,
EP over every rank of the role, the source's redundant experts, MTP and EPLB), per rank,
then scaled to the source's unit (a node of 8 GPUs, a 2-die 910C NPU). Prefill: a forward of
``tokens`` computed tokens per rank made of ``length``-token prompts (with cache hits, each
prompt's last ``1 - hit`` share, attending over its cached prefix); decode: one step of ``tokens``
sequences per rank at ``length`` context. No figure of these sources is an input of the model
(devices.yaml holds operator benchmarks only). Seed 004 is planned from its orch config.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from engine.model_config import ModelConfig
from orchestrator.config.memory_plan import Precision, plan_role
from orchestrator.config.role_layout import RoleLayout
from orchestrator.config.load import load_config
from orchestrator.planner import counts
from orchestrator.planner.cost import decode_step_cost, forward_cost
from orchestrator.planner.hardware import Hardware
from orchestrator.planner.terms import Cost, Work
from orchestrator.planner.explain import cost_lines
from orchestrator.planner.load import WorkloadSpec
from orchestrator.planner.moe import StepOptions, experts_per_rank
from orchestrator.planner.report import plan_config
from orchestrator.planner.specs import named_device

REPO = Path(__file__).resolve().parents[2]
DAY6 = ("DeepSeek, \"Day 6: One More Thing, DeepSeek-V3/R1 Inference System Overview\" "
        "(github.com/deepseek-ai/open-infra-index, 2025-03-01)")
LMSYS = ("LMSYS, \"Deploying DeepSeek with PD Disaggregation and Large-scale Expert "
         "Parallelism on 96 H100 GPUs\" (lmsys.org/blog/2025-05-05-large-scale-ep)")
CM384 = ("Zuo et al., \"Serving Large Language Models on Huawei CloudMatrix384\" "
         "(arXiv:2506.12708)")


@dataclass(frozen=True)
class Published:
    """One published throughput and the setting its source gives.

    Attributes:
        key: short name (``--row``).
        source: title and address.
        device: devices.yaml entry.
        role: "prefill" (input tokens/s) or "decode" (output tokens/s).
        ranks: ranks of the role's EP group (DP attention: dp = ranks, tp 1).
        redundant: redundant expert slots.
        length: prompt tokens (prefill) or context tokens (decode).
        tokens: tokens per rank per forward (prefill) or sequences per rank (decode).
        figure: the published throughput, per ``per`` ranks.
        per: ranks per published unit (8: a node; 2: a 910C NPU of 2 dies).
        unit: words for the unit.
        mtp, accept: draft tokens per step and acceptance.
        hit: share of input tokens served from a prefix cache (counted, not computed).
        linear_bytes: bytes per linear weight (1: FP8 / INT8 W8A8).
        fleet: the figure is a production fleet's 24 h average (capacity x an unknown
            utilization), not a measurement at full load.
        attn_tp: prefill's attention core by heads over this many ranks (SP-TP-SP).
        balanced: the source simulates perfectly balanced routing (uniform, group-limited),
            so no drift from EPLB's statistics (:data:`.moe.EPLB_DRIFT`); else real routing
            with EPLB.
        capacity: fleet rows: the same operator's full-load figure at that layout in the
            row's unit (DeepSeek's profile as LMSYS estimates it), 0 if none; published /
            capacity is the utilization the sources themselves imply.
        setting: what of the setting is the source's and what is assumed.
    """

    key: str
    source: str
    device: str
    role: str
    ranks: int
    redundant: int
    length: int
    tokens: int
    figure: float
    per: int
    unit: str
    mtp: int = 0
    accept: float = 0.0
    hit: float = 0.0
    linear_bytes: float = 1.0
    fleet: bool = False
    attn_tp: int = 1
    balanced: bool = False
    capacity: float = 0.0
    setting: str = ""


LMSYS_RUN = ("32 redundant, 16,384 tokens a rank: the source's reproduction commands "
             "(github.com/sgl-project/sglang issue 6017, prefill server: "
             "--ep-num-redundant-experts 32, --chunked-prefill-size 524288 over dp 32)")
PROFILE = ("DeepSeek profile-data README (github.com/deepseek-ai/profile-data): prefill "
           "profiled at EP32, 4K prompts, 16K tokens per GPU, 'in line with the actual online "
           "deployment'")

ROWS = (
    Published("day6-prefill", DAY6, "h800", "prefill", 32, 32, 4096, 16384, 73_700, 8,
              "input tok/s per node", hit=0.563, fleet=True, capacity=62_713 / (1 - 0.563),
              setting="EP32 on 4 nodes, 32 redundant experts, 9 routed per GPU, 73.7k "
              "including cache hits, 56.3 % of input tokens hit the on-disk KV cache (source); "
              "4K prompts, 16K tokens per GPU per forward: " + PROFILE + "; a 24 h fleet "
              "average (nodes scaled with load, not always busy)"),
    Published("day6-decode", DAY6, "h800", "decode", 144, 32, 4989, 88, 14_800, 8,
              "output tok/s per node", mtp=1, accept=0.85, fleet=True, capacity=18_598,
              setting="EP144 on 18 nodes, 32 redundant, 2 routed per GPU (source); average KV "
              "length per output token 4,989 (source, as quoted); 20-22 tok/s per user at "
              "1,850 tok/s per GPU -> ~88 sequences per GPU (Little); MTP accept 0.85 "
              "(DeepSeek-V3 report: second-token acceptance 85-90 %); a 24 h fleet average "
              "(LMSYS's table reads this deployment as batch 128 at KV 4,989)"),
    *(Published(f"lmsys-prefill-{n // 1024}k", LMSYS, "h100", "prefill", 32, 32, n, 16384,
                fig, 8, "input tok/s per node",
                setting=f"prefill-only run on 4 nodes (EP32), {n}-token prompts: {fig:,} tok/s "
                "per node; TBO lets a device take 16,384 tokens per batch (source); EPLB "
                "from a distribution matching the data (source), so the routing imbalance "
                "EPLB leaves is in the figure; " + LMSYS_RUN) for n, fig in
      ((1024, 57_674), (2048, 54_543), (4096, 50_302))),
    Published("lmsys-prefill-4k-perfect", LMSYS, "h100", "prefill", 32, 32, 4096, 16384,
              59_337, 8, "input tok/s per node", balanced=True,
              setting="16,384 tokens per device, 4,096-token prompts, simulated perfect EPLB "
              "('random expert selection following group-limited routing semantics') "
              "(source, 'Overall Throughput' table); " + LMSYS_RUN),
    Published("lmsys-decode", LMSYS, "h100", "decode", 72, 32, 2000, 256, 22_282, 8,
              "output tok/s per node",
              setting="9 decode nodes EP72, batch 256 per device, KV length 2,000, no MTP "
              "(source, decode table); 288 expert slots (source)"),
    Published("lmsys-decode-mtp", LMSYS, "h100", "decode", 72, 32, 4000, 128, 17_373, 8,
              "output tok/s per node", mtp=1, accept=0.6,
              setting="simulated MTP: 128 sequences per device at KV 4,000 (the source runs "
              "2x the batch at half the KV and slows attention to DeepSeek's profiled time), "
              "60 % acceptance (source); EP72, 288 slots (source)"),
    Published("cm384-prefill", CM384, "a3", "prefill", 32, 0, 4096, 8192, 6_688, 2,
              "input tok/s per NPU", attn_tp=32, balanced=True,
              setting="INT8 (W8A8), 4K prompts, a batch of 16,384 tokens per accelerator "
              "(NPU: 8,192 per die), perfect EPLB (the paper's Table 2, as two secondary "
              "summaries reproduce it; its default-EPLB figure 5,655); 6 prefill instances "
              "on 96 NPUs: 16 NPUs = 32 dies, EP32; MLA as SP-TP-SP over the instance's 32 "
              "dies (down projections and o_proj sequence-parallel, the attention core by "
              "heads, one all-gather and one all-to-all a layer: the paper's sec. 4 and "
              "Fig. 16-17, as a secondary summary reproduces them; their dtype (bf16) and "
              "that they are not overlapped are assumed)"),
    Published("cm384-decode", CM384, "a3", "decode", 320, 64, 4096, 48, 1_943, 2,
              "output tok/s per NPU", mtp=1, accept=0.7,
              setting="INT8, EP320 on 160 NPUs, 4K KV, batch 96 per NPU (48 per die), "
              "TPOT 49.4 ms, MTP one draft token at 70 % acceptance (the paper's Table 3 and "
              "setup, as secondary summaries reproduce them); 64 redundant slots (320 - 256) "
              "as recalled, unverified"),
    Published("cm384-decode-15ms", CM384, "a3", "decode", 320, 64, 4096, 4, 538, 2,
              "output tok/s per NPU", mtp=1, accept=0.7,
              setting="538 tok/s per NPU under a 15 ms TPOT bound at batch 8 per NPU (4 per "
              "die) (source); the rest as cm384-decode"),
)

# Operator-level checks, not in the error: DeepSeek's own profiles (balanced routing, one
# layout, one batch), the figure a step time (decode, ms) or a rate (prefill, tok/s per GPU).
CHECKS = (
    Published("profile-decode", "DeepSeek profile-data decode trace (EP128, 4K, 128 "
              "requests per GPU, two micro-batches) as a reader tabulated it "
              "(zdszero.github.io, deepseek_profile.html): 61 layers ~87.3 ms", "h800",
              "decode", 128, 0, 4096, 128, 87.3, 1, "ms per step (61 layers)", mtp=1,
              accept=0.85, balanced=True, setting="end to end 96 ms (the MTP module's terms "
              "left out of the prediction); 128 tokens per micro-batch "
              "(its dispatch 187 us ~ DeepEP's EP128 192 us for 128 tokens): MTP 1 taken"),
    Published("profile-prefill", "LMSYS's throughput estimate from DeepSeek's profile-data "
              "prefill trace (EP32, 4,096-token prompts, 16,384 tokens per GPU): 62,713 "
              "tok/s per node (" + LMSYS + ", 'Overall Throughput' table)", "h800", "prefill",
              32, 32, 4096, 16384, 62_713 / 8, 1, "input tok/s per GPU", balanced=True,
              setting="'we simulate an absolutely balanced MoE routing strategy for "
              "profiling' (profile-data README)"),
    Published("profile-decode-rate", "LMSYS's throughput estimate from DeepSeek's profile-data "
              "decode trace: 18,598 tok/s per node at batch 128, KV 4,096, 16 nodes (" + LMSYS
              + ", decode table)", "h800", "decode", 128, 0, 4096, 128, 18_598 / 8, 1,
              "output tok/s per GPU", mtp=1, accept=0.6, balanced=True,
              setting="MTP 1 at LMSYS's conservative 60 % acceptance (the same source's "
              "simulated-MTP assumption)"),
)


def _model() -> ModelConfig:
    raw = json.loads((REPO / "configs/models/deepseek-v3/config.json").read_text())
    return ModelConfig.from_dict(raw)


def row_cost(row: Published) -> tuple[Cost, float]:
    """(the cost of one forward / step of one rank, the predicted figure in the row's
    unit)."""
    m = _model()
    lay = RoleLayout(row.role, row.ranks, 1, True, 1, 128, row.tokens, row.tokens,
                     row.length + 1024)
    prec = Precision(linear=row.linear_bytes, weight=2, kv=2, activation=2)
    # NOTE: the memory plan (the engine's layout) needs an EP size that divides the experts:
    # plan the rank as holding its share of the experts plus their redundant copies.
    slots = experts_per_rank(m, row.ranks, row.redundant) * row.ranks
    plan = plan_role(replace(m, n_routed_experts=slots), lay, prec)
    hw = Hardware(named_device(row.device))
    opts = StepOptions(mtp=row.mtp, accept=row.accept, redundant=row.redundant,
                       attn_tp=row.attn_tp, **({"drift": 0.0} if row.balanced else {}))
    if row.role == "prefill":
        # NOTE: with cache hits each prompt computes its last (1 - hit) share, attending over
        # the cached prefix too
        new = round(row.length * (1 - row.hit))
        prompts = row.tokens / new
        attn = prompts * counts.attention_flops(m, new, row.length - new, absorbed=False)
        up = prompts * counts.prefix_up_flops(m, row.length - new)
        keys = counts.mha_keys(m, new, row.length - new)
        cost = forward_cost(m, plan, prec, hw, opts,
                            Work(row.tokens, attn, 0.0, 0.0, False, up, keys))
        return cost, row.tokens / cost.total_s / (1 - row.hit) * row.per
    cost = decode_step_cost(m, plan, prec, hw, row.tokens, row.length, opts)
    if row.unit.startswith("ms per step"):
        # NOTE: the figure is the 61 decoder layers' time: the MTP module (serial) left out
        mtp = sum(t.seconds for t in cost.terms if t.name.startswith("MTP draft"))
        return cost, (cost.total_s - mtp) * 1e3
    return cost, row.tokens * cost.tokens_per_step / cost.total_s * row.per


def seed_rows() -> list[tuple[str, float, float]]:
    """Seed 004 (configs/a3_v32_p2x16_d8x4.yaml, concurrency 29): (figure, published,
    predicted) for TPOT (ms), output tokens/s and TTFT (s), under both load shapes the seed
    may have run (it publishes none): arrivals spread out ("staggered") and the 29 requests
    started together, as a closed-loop bench of equal-length requests does ("lock-step")."""
    cfg = load_config(REPO / "configs" / "a3_v32_p2x16_d8x4.yaml")
    out = []
    for name, together in (("staggered", False), ("lock-step", True)):
        pt = plan_config(cfg, WorkloadSpec(65536, 3072, concurrency=29, together=together),
                         named_device("a3")).point
        out += [(f"{name} TPOT ms", 26.0, pt.tpot_s * 1e3),
                (f"{name} output tok/s", 850.0, pt.output_tok_s),
                (f"{name} TTFT s", 24.0, pt.ttft_s)]
    return out


def table() -> list[dict]:
    """Every row: key, role, device, published, predicted, ratio."""
    out = []
    for row in ROWS:
        _, pred = row_cost(row)
        out.append({"key": row.key, "role": row.role, "device": row.device,
                    "unit": row.unit, "published": row.figure, "predicted": pred,
                    "ratio": pred / row.figure, "fleet": row.fleet})
    for name, pub, pred in seed_rows():
        out.append({"key": f"seed004 {name}", "role": "seed", "device": "a3", "unit": name,
                    "published": pub, "predicted": pred, "ratio": pred / pub, "fleet": False})
    return out


def summary(rows: list[dict]) -> str:
    """Median and worst |ratio - 1| over the goal set: the independent capacity rows (not the
    seed, not the fleet averages); the fleet averages as the utilization they imply."""
    errs = [abs(r["ratio"] - 1) for r in rows if r["role"] != "seed" and not r["fleet"]]
    fleet = ", ".join(f"{r['key']} {1 / r['ratio']:.2f}" for r in rows if r["fleet"])
    return (f"median |predicted/published - 1| {statistics.median(errs):.0%}, worst "
            f"{max(errs):.0%} over {len(errs)} capacity throughputs; fleet averages (not "
            f"capacity, not in the goal set), published / predicted capacity: {fleet}")


def _row_table(rows: list[dict], role: str, fleet: bool) -> list[str]:
    """Markdown rows of one role's capacity rows, or of the fleet averages."""
    out = []
    for r, row in ((r, next(x for x in ROWS if x.key == r["key"])) for r in rows
                   if r["role"] == role and r["fleet"] == fleet):
        work = (f"{row.length}-token prompts, {row.tokens} computed tokens per rank per "
                f"forward" if role == "prefill" else
                f"{row.tokens} sequences per rank at {row.length} context"
                + (f", MTP {row.mtp} at accept {row.accept}" if row.mtp else ""))
        cells = [row.key, row.source, f"{row.device}, EP {row.ranks} (DP attention), "
                 f"{row.redundant} redundant", f"{work}; {row.setting}",
                 f"{row.figure:,.0f} {row.unit}", f"{r['predicted']:,.0f}"]
        cells += ([f"{1 / r['ratio']:.2f}", f"{row.capacity:,.0f}",
                   f"{row.figure / row.capacity:.2f}"] if fleet else [f"{r['ratio']:.2f}"])
        out.append("| " + " | ".join(cells) + " |")
    return out


def markdown(rows: list[dict]) -> str:
    """The docs/planner.md tables: prefill rows, decode rows, the fleet averages, seed 004,
    the profile checks, the summary."""
    head = ("| row | source | device, layout | workload | published | predicted | ratio |\n"
            "|---|---|---|---|---|---|---|")
    out = []
    for role, title in (("prefill", "Prefill (input tokens/s)"),
                        ("decode", "Decode (output tokens/s)")):
        out += [f"### {title}", "", head, *_row_table(rows, role, False), ""]
    out += ["### Fleet averages (DeepSeek Day 6; not capacity figures, not in the goal set)",
            "", "| row | source | device, layout | workload | published | predicted capacity "
            "| published / predicted | DeepSeek's profile at that layout | published / "
            "profile |", "|---|---|---|---|---|---|---|---|---|",
            *_row_table(rows, "prefill", True), *_row_table(rows, "decode", True), ""]
    out += ["### Seed 004 (configs/a3_v32_p2x16_d8x4.yaml, `--workload "
            "in=65536,out=3072,concurrency=29`, lock-step: `...,start=together`)", "",
            "| row | published | predicted | ratio |", "|---|---|---|---|"]
    out += [f"| {r['key']} | {r['published']:.4g} | {r['predicted']:.3g} | {r['ratio']:.2f} |"
            for r in rows if r["role"] == "seed"]
    out += ["", "### Checks against DeepSeek's profiles (operator level, not in the error)", "",
            "| check | source | figure | predicted | ratio |", "|---|---|---|---|---|"]
    for row in CHECKS:
        pred = row_cost(row)[1]
        out.append(f"| {row.key} | {row.source}; {row.setting} | {row.figure:,.4g} "
                   f"{row.unit} | {pred:,.4g} | {pred / row.figure:.2f} |")
    return "\n".join(out + ["", summary(rows) + "."])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--explain", action="store_true", help="every term of each row")
    p.add_argument("--row", choices=[r.key for r in ROWS + CHECKS], default=None,
                   help="this row only (with its terms)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="the tables of docs/planner.md")
    ns = p.parse_args(argv)
    if ns.row:
        row = next(r for r in ROWS + CHECKS if r.key == ns.row)
        cost, pred = row_cost(row)
        print(f"{row.key}: published {row.figure:.4g}, predicted {pred:.4g} {row.unit} "
              f"(ratio {pred / row.figure:.2f})")
        print("\n".join(cost_lines(cost, 1e3, "ms", "    ")))
        return 0
    rows = table()
    if ns.json or ns.markdown:
        print(json.dumps(rows, indent=1) if ns.json else markdown(rows))
        return 0
    for row in CHECKS:
        print(f"check {row.key}: published {row.figure:.4g}, predicted {row_cost(row)[1]:.4g} "
              f"{row.unit}")
    for r, row in zip(rows, list(ROWS) + [None] * 6):
        print(f"{r['key']:<30} {r['device']:<5} published {r['published']:>9.4g}  predicted "
              f"{r['predicted']:>9.4g}  ratio {r['ratio']:.2f}  ({r['unit']})")
        if ns.explain and row is not None:
            print("\n".join(cost_lines(row_cost(row)[0], 1e3, "ms", "    ")))
    print(summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
