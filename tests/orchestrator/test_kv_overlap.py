"""`orch plan`'s KV overlap (issue 27): the closed form of the KV left after the prefill
forward equals a brute-force run of the link, and a plan with layer-by-layer sends waits less
for its second token than one that sends after each chunk's forward."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from orchestrator.config.load import load_config
from orchestrator.planner.load import WorkloadSpec
from orchestrator.planner.kv_tail import kv_tail_s, staged_tail_s
from orchestrator.planner.report import plan_config
from orchestrator.planner.specs import default_device
from tests.e2e.harness import REPO


def _link_tail(transfer_s: float, prefill_s: float, units: int) -> float:
    """Unit k is ready at k * prefill_s / units and crosses the link after the ones before."""
    free = 0.0
    for k in range(1, units + 1):
        free = max(free, k * prefill_s / units) + transfer_s / units
    return free - prefill_s


@pytest.mark.parametrize("transfer_s, prefill_s, chunks, layers", list(itertools.product(
    (0.01, 0.5, 2.0), (0.1, 1.0), (1, 4), (1, 3, 61))))
def test_closed_form_is_the_link_run(transfer_s, prefill_s, chunks, layers):
    assert kv_tail_s(transfer_s, prefill_s, chunks, layers, True) == pytest.approx(
        _link_tail(transfer_s, prefill_s, chunks * layers))
    assert kv_tail_s(transfer_s, prefill_s, chunks, layers, False) == pytest.approx(
        _link_tail(transfer_s, prefill_s, chunks))


@pytest.mark.parametrize("transfer_s, prefill_s, chunks", list(itertools.product(
    (0.01, 0.5, 2.0), (0.1, 1.0), (1, 4, 7))))
def test_staged_units_of_equal_bytes_are_the_closed_form(transfer_s, prefill_s, chunks):
    """DeepSeek-V4's run over chunks of unequal bytes, given equal ones, is the closed form."""
    assert staged_tail_s(transfer_s, prefill_s, [1 / chunks] * chunks) == pytest.approx(
        kv_tail_s(transfer_s, prefill_s, chunks, 1, False))


def test_staged_units_a_link_that_keeps_up_leaves_the_last_units_bytes():
    """Unequal units: a fast link leaves the last one's bytes; a slow one runs from the first
    unit (ready at 0.5 / 3 s) through all 1 s of transfer, less the 0.5 s forward."""
    assert staged_tail_s(0.01, 1.0, [0.5, 0.3, 0.2]) == pytest.approx(0.2 * 0.01)
    assert staged_tail_s(1.0, 0.5, [0.5, 0.3, 0.2]) == pytest.approx(
        0.5 / 3 + 1.0 - 0.5)
    with pytest.raises(ValueError, match="no units"):
        staged_tail_s(1.0, 1.0, [])


def test_layerwise_plan_waits_less_for_the_second_token():
    cfg = load_config(REPO / "configs" / "1p1d.yaml")
    off = cfg.model_copy(update={"kv_transfer": cfg.kv_transfer.model_copy(
        update={"layerwise": False})})
    wl = WorkloadSpec(256, 16, concurrency=1)
    # NOTE: a slow link, so the transfer is not lost in the noise of the other terms
    device = replace(default_device("cuda"), link_latency_us=500.0)
    on_plan, off_plan = plan_config(cfg, wl, device), plan_config(off, wl, device)
    assert on_plan.transfer.total_s == off_plan.transfer.total_s
    layers = on_plan.memory.model.num_hidden_layers
    chunks = -(-256 // cfg.prefill.chunk_size)
    assert off_plan.kv_tail_s == pytest.approx(kv_tail_s(
        off_plan.transfer.total_s, off_plan.prefill_cost.total_s, chunks, layers, False))
    assert on_plan.kv_tail_s < off_plan.kv_tail_s
    assert on_plan.point.tpot_s < off_plan.point.tpot_s
    with pytest.raises(ValueError, match="chunks"):
        kv_tail_s(1.0, 1.0, 0, 3, True)
