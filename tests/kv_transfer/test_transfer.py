"""End-to-end KV transfer between spawned prefill and decode ranks (CPU, gloo)."""

import pytest

from .cluster import CTX, Scenario, decode_rank, prefill_rank, run_ranks


def _run(s: Scenario) -> dict:
    addr_qs = [CTX.Queue() for _ in range(s.prefill_tp)]
    barrier = CTX.Barrier(s.prefill_tp + s.decode_tp)
    targets = [(decode_rank, ("decode", d, s, addr_qs, barrier)) for d in range(s.decode_tp)]
    targets += [(prefill_rank, ("prefill", p, s, addr_qs, barrier)) for p in range(s.prefill_tp)]
    out = run_ranks(targets, timeout_s=90)
    assert len(out) == len(targets), f"ranks did not report: {sorted(out)}"
    errors = {k: v[0] for k, v in out.items() if v[0]}
    assert not errors, "\n".join(f"{k}: {e}" for k, e in errors.items())
    return out


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_bytes_arrive_slot_by_slot(p_tp, d_tp):
    s = Scenario(prefill_tp=p_tp, decode_tp=d_tp)
    out = _run(s)
    per_token_layer = (s.kv_lora_rank + s.rope_dim) * 4
    received = sum(v[1]["bytes"] for k, v in out.items() if k[0] == "decode")
    sent = sum(v[1]["bytes"] for k, v in out.items() if k[0] == "prefill")
    # every decode rank receives every layer of every token exactly once
    assert received == sent == d_tp * s.num_layers * s.num_tokens * per_token_layer
