"""DeepSeek-V4 group pools sized by the request shape (engine/pool_plan.py): what the memory
plan prints is what a rank's runner builds (tiny PD config; a TP x EP colocated rank), the
groups run out together, and admission still refuses per group what does not fit."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockSet
from engine.parallel import EPGroup, TPGroup
from engine.runner import build_runner
from engine.v4.admission import V4Admission
from engine.v4.config import V4Config
from engine.v4.kv_spec import layer_specs
from engine.pool_plan import RequestShape, plan_pools
from engine.v4.runner import serving_pools
from orchestrator.config.load import load_config
from orchestrator.config.memory_check import build_memory_plan
from orchestrator.config.memory_plan_v4 import pool_plan
from orchestrator.tiny_model_v4 import tiny_v4_config_dict
from tests.e2e.harness import REPO

TINY = V4Config.from_dict(tiny_v4_config_dict())  # window 8, CSA 1/4 (2 layers), HCA 1/16
TINY_SPECS = layer_specs(TINY)
STORED = ("window", "entries/compressed_sparse_attention",
          "entries/heavily_compressed_attention")


def _plan_and_runners(config: str, overrides: dict, ckpt, groups: dict) -> list:
    """(plan's pools, the runner's pools, the runner's PagedKV bytes, the plan's KV rows'
    bytes) per role of ``config`` at ``overrides``, the runner built as rank/rank.py builds it
    (``groups``: role -> (tp, ep) groups of the rank built)."""
    cfg = load_config(REPO / "configs" / config, {**overrides, "model.path": str(ckpt)})
    plan, _ = build_memory_plan(cfg)
    out = []
    for inst in cfg.instances():
        role = next(r for r in plan.roles if r.layout.role == inst.role)
        tp, ep = groups.get(inst.role, (None, None))
        s = inst.scheduler
        runner = build_runner(ckpt, num_kv_blocks=s.num_kv_blocks, block_size=s.block_size,
                              tp=tp, ep=ep, v4_shape=s.v4_shape)  # NOTE: as rank/rank.py
        stored = [runner.kv.window, *runner.kv.entries.values(),
                  *runner.kv.index_keys.values()]
        rows = [r for r in role.rows if r.group == "kv" and r.kind.startswith("KV: ")
                and r.kind not in ("KV: compressor state", "KV: PD staging rows")]
        out.append((pool_plan(plan.model, role.layout).blocks,
                    {n: p.num_blocks for n, p in runner.pools.items()},
                    sum(t.numel() * t.element_size() for t in stored),
                    sum(r.bytes for r in rows)))
    return out


def test_plan_is_what_the_pd_ranks_build(tiny_v4_ckpt):
    """configs/v4_1p1d.yaml: prefill (chunks of 64: a window of 6 blocks a request) and decode
    (2) pools as the plan prints them, the plan's KV rows = the runner's tensors (fp32)."""
    got = _plan_and_runners("v4_1p1d.yaml", {}, tiny_v4_ckpt, {})
    assert [g[0]["window"] for g in got] == [8 * 6, 8 * 2]  # max_num_seqs 8 each
    for planned, built, allocated, printed in got:
        assert planned == built
        assert allocated == printed


def test_plan_is_what_a_tp_ep_rank_builds(tiny_v4_ckpt):
    """configs/v4_ep_colocated.yaml at decode.tp 2 (EP over 4 ranks): a TP x EP rank holds the
    whole V4 cache, sized as the plan says."""
    groups = {"colocated": (TPGroup(rank=1, size=2), EPGroup(rank=3, size=4))}
    got = _plan_and_runners("v4_ep_colocated.yaml", {"decode.tp": 2}, tiny_v4_ckpt, groups)
    for planned, built, allocated, printed in got:
        assert planned == built and allocated == printed


def test_a_colocated_rank_from_the_config_builds_the_plan(tiny_v4_ckpt):
    """``orch up``'s path: configs/v4_colocated.yaml's instance config -> Rank (rank/rank.py
    hands ``SchedulerConfig.v4_shape`` to ``build_runner``): its pools and its admission's are
    the plan's; it serves three requests on them and every block comes back."""
    from rank.colocated import ColocatedRole  # noqa: PLC0415
    from rank.rank import Rank  # noqa: PLC0415
    from tests.engine.test_v4_runner import _collect, _generate, _wait_v4_free  # noqa: PLC0415

    cfg = load_config(REPO / "configs" / "v4_colocated.yaml", {"model.path": str(tiny_v4_ckpt)})
    plan, _ = build_memory_plan(cfg)
    (inst, *_), (role,) = cfg.instances(), plan.roles
    rank = Rank(inst, 0, ColocatedRole)
    rank.start_alone()
    try:
        built = {n: p.num_blocks for n, p in rank.runner.pools.items()}
        assert built == pool_plan(plan.model, role.layout).blocks
        assert rank.leader.scheduler.admission.pools is rank.runner.pools
        assert built["window"] == 8 * 6  # max_num_seqs 8, chunks of 64: 6 blocks of 16
        for i, n in enumerate((40, 70, 100)):
            rank.request(_generate(f"r{i}", n, i, 8))
        out = _collect(rank, {f"r{i}": ([], None, None) for i in range(3)})
        assert {rid: (len(t), reason) for rid, (t, reason, _) in out.items()} == \
            {f"r{i}": (8, "length") for i in range(3)}, out
        _wait_v4_free(rank.runner)
    finally:
        rank.shutdown()


def _fill(admission: V4Admission, need: dict[str, int]) -> int:
    """Commit ``need`` until it does not fit; how many did."""
    n = 0
    while admission.can_admit(need):
        admission.commit(BlockSet(set_id=n, block_ids=(n,), pool_id=0), need)
        n += 1
    return n


def test_groups_run_out_together():
    """Budget 10 blocks of 16 in every group, 256-token requests at a token a step (window 2
    blocks, CSA 4, HCA 1 each: the budget holds 3.8): every stored group refuses the 4th, none
    before; pools of 10 blocks each would hold 2, short only of CSA entries."""
    plan = plan_pools(TINY_SPECS, 10, 16, RequestShape(8, 256, 1))
    assert plan.blocks == {"window": 7, "entries/compressed_sparse_attention": 15,
                           "state/compressed_sparse_attention": 4,
                           "entries/heavily_compressed_attention": 3,
                           "state/heavily_compressed_attention": 4}
    assert plan.stored_elements() <= plan_pools(TINY_SPECS, 10, 16, None).stored_elements()
    for pools, fits, short in ((plan, 3, STORED),
                               (plan_pools(TINY_SPECS, 10, 16, None), 2,
                                ("entries/compressed_sparse_attention",))):
        admission = V4Admission(TINY, serving_pools(pools), 16, staged=False)
        need = admission.need(256, 1)
        assert _fill(admission, need) == fits
        reason = admission.describe(need)
        assert [g for g in admission.pools if f"{g}: " in reason] == list(short), reason


def test_capped_by_max_num_seqs_and_refusals_name_the_group():
    """A budget holding 24 requests sized for max_num_seqs 2: exactly two 256-token requests
    fit; a longer one (over max_model_len: the router's limit) is refused naming its groups."""
    plan = plan_pools(TINY_SPECS, 64, 16, RequestShape(2, 256, 1))
    assert plan.capped and plan.requests == 2 and plan.budget_requests > 24
    assert plan.blocks == {g: 2 * n for g, n in plan.per_request.items()}
    admission = V4Admission(TINY, serving_pools(plan), 16, staged=False)
    assert _fill(admission, admission.need(256, 1)) == 2
    reason = admission.refusal(admission.need(1024, 1))  # NOTE: 256 CSA entries, 64 HCA
    assert "entries/compressed_sparse_attention: 16, 8" in reason, reason
    assert "entries/heavily_compressed_attention: 4, 2" in reason and "window" not in reason
    assert admission.refusal(admission.need(256, 1)) is None


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        RequestShape(2, 0)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        plan_pools(TINY_SPECS, 0, 16, None)
