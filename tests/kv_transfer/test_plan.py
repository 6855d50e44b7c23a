"""Transfer plan properties over every tp combination and layer count."""

from collections import Counter

import pytest

from kv_transfer.layout import rank_heads
from kv_transfer.plan import build_transfer_plan


@pytest.mark.parametrize("p_tp", range(1, 9))
@pytest.mark.parametrize("d_tp", range(1, 9))
def test_mla_plan_coverage_and_balance(p_tp, d_tp):
    for layers in range(1, 62):
        plan = build_transfer_plan(p_tp, d_tp, layers)
        got = Counter((pp.decode_rank, layer) for pp in plan.pairs for layer in pp.layers)
        want = {(d, layer) for d in range(d_tp) for layer in range(layers)}
        assert set(got) == want, (p_tp, d_tp, layers)
        assert max(got.values()) == 1  # no duplicates
        sent = [sum(len(pp.layers) for pp in plan.sends_from(p)) for p in range(p_tp)]
        assert max(sent) - min(sent) <= 1, (p_tp, d_tp, layers, sent)  # within one layer
        for d in range(d_tp):
            assert plan.recvs_to(d), "every decode rank has a sender (done records)"
        for pp in plan.pairs:
            assert pp.layers == tuple(sorted(pp.layers)) and pp.heads is None
            assert pp.layers, "no empty pairs"


def test_mla_named_shapes():
    plan = build_transfer_plan(16, 4, 61)
    for p in range(16):
        (pair,) = plan.sends_from(p)
        assert pair.decode_rank == p // 4
        assert len(pair.layers) in (15, 16)
    assert sorted(len(pp.layers) for pp in plan.recvs_to(0)) == [15, 15, 15, 16]
    p1d2 = build_transfer_plan(1, 2, 61)
    assert [(pp.decode_rank, pp.layers) for pp in p1d2.sends_from(0)] == \
        [(0, tuple(range(61))), (1, tuple(range(61)))]
    p2d1 = build_transfer_plan(2, 1, 61)
    assert [pp.layers for pp in p2d1.recvs_to(0)] == [tuple(range(31)), tuple(range(31, 61))]
    assert [pp.prefill_rank for pp in p2d1.recvs_to(0)] == [0, 1]
    assert [pp.decode_rank for pp in p2d1.sends_from(1)] == [0]
    p3d2 = build_transfer_plan(3, 2, 61)
    assert [len(pp.layers) for pp in p3d2.pairs] == [41, 20, 21, 40]


def test_plan_with_fewer_layers_than_ranks_leaves_idle_ranks():
    plan = build_transfer_plan(8, 1, 1)
    assert plan.sends_from(0)[0].layers == (0,)
    assert all(plan.sends_from(p) == () for p in range(1, 8))


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_gqa_plan_head_coverage(heads):
    for p_tp in range(1, 9):
        for d_tp in range(1, 9):
            if not _splits(p_tp, heads) or not _splits(d_tp, heads):
                continue
            for layers in (1, 3, 7, 61):
                plan = build_transfer_plan(p_tp, d_tp, layers, "gqa", heads)
                got = Counter((pp.decode_rank, h, layer) for pp in plan.pairs
                              for h in pp.heads for layer in pp.layers)
                want = {(d, h, layer) for d in range(d_tp) for h in rank_heads(d_tp, heads, d)
                        for layer in range(layers)}
                assert set(got) == want and max(got.values()) == 1, (p_tp, d_tp, layers)
                for pp in plan.pairs:  # senders hold what they send
                    assert set(pp.heads) <= set(rank_heads(p_tp, heads, pp.prefill_rank))
                sent = [sum(len(pp.layers) * len(pp.heads) for pp in plan.sends_from(p))
                        for p in range(p_tp)]
                assert max(sent) - min(sent) <= 1, (p_tp, d_tp, layers, sent)


def test_gqa_regroups_heads():
    p2d4 = build_transfer_plan(2, 4, 4, "gqa", 8)
    assert [(pp.prefill_rank, pp.decode_rank, pp.heads) for pp in p2d4.pairs] == \
        [(0, 0, range(0, 2)), (0, 1, range(2, 4)), (1, 2, range(4, 6)), (1, 3, range(6, 8))]
    p4d2 = build_transfer_plan(4, 2, 4, "gqa", 8)
    assert [(pp.prefill_rank, pp.heads) for pp in p4d2.recvs_to(1)] == \
        [(2, range(4, 6)), (3, range(6, 8))]
    p3d1 = build_transfer_plan(3, 1, 5, "gqa", 3)
    assert [(pp.prefill_rank, pp.heads, pp.layers) for pp in p3d1.pairs] == \
        [(p, range(p, p + 1), tuple(range(5))) for p in range(3)]


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_transfer_plan(2, 2, 4, "gqa")
    with pytest.raises(ValueError, match="cannot be split"):
        build_transfer_plan(3, 1, 4, "gqa", 4)
    with pytest.raises(ValueError, match="positive"):
        build_transfer_plan(0, 1, 4)


def _splits(tp, heads):
    return heads % tp == 0 or tp % heads == 0


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("d_tp", [1, 2, 3, 4])
def test_cp_plan_ships_every_layer_token_once_balanced(cp, d_tp):
    for layers in (1, 3, 61):
        plan = build_transfer_plan(1, d_tp, layers, prefill_cp=cp)
        for start, end in ((0, 1), (0, 7), (5, 21), (64, 1088)):
            got = Counter()
            sent = []
            for p in range(cp):
                ranges = plan.token_ranges(p, start, end)
                tokens = [t for a, b in ranges for t in range(a, b)]
                assert ranges == tuple(sorted(ranges)) and all(a < b for a, b in ranges)
                sent.append(len(tokens))
                for pp in plan.sends_from(p):
                    assert pp.cp_rank == p
                    got.update((pp.decode_rank, layer, t) for layer in pp.layers
                               for t in tokens)
            want = {(d, layer, t) for d in range(d_tp) for layer in range(layers)
                    for t in range(start, end)}
            assert set(got) == want and max(got.values()) == 1, (cp, d_tp, layers, start, end)
            assert max(sent) - min(sent) <= 2, sent  # bytes within two tokens (all layers)


@pytest.mark.parametrize("cp,p_tp,d_tp", [(2, 2, 1), (2, 2, 4), (2, 4, 2), (4, 2, 3)])
def test_cp_plan_over_tp_groups_shards_layers_within_each(cp, p_tp, d_tp):
    plan = build_transfer_plan(p_tp, d_tp, 7, prefill_cp=cp)
    got = Counter((pp.decode_rank, layer, t) for pp in plan.pairs for layer in pp.layers
                  for a, b in plan.token_ranges(pp.prefill_rank, 0, 40) for t in range(a, b))
    assert set(got) == {(d, layer, t) for d in range(d_tp) for layer in range(7)
                        for t in range(40)}
    assert max(got.values()) == 1
    for p in range(cp * p_tp):  # ranks of one CP rank share its tokens, split the layers
        assert {pp.cp_rank for pp in plan.sends_from(p)} <= {p // p_tp}
    for d in range(d_tp):
        assert {pp.cp_rank for pp in plan.recvs_to(d)} == set(range(cp))


def test_cp_named_shapes():
    plan = build_transfer_plan(1, 1, 4, prefill_cp=2)
    assert [(pp.prefill_rank, pp.layers) for pp in plan.recvs_to(0)] == \
        [(0, tuple(range(4))), (1, tuple(range(4)))]
    assert plan.token_ranges(0, 100, 108) == ((100, 102), (106, 108))
    assert plan.token_ranges(1, 100, 108) == ((102, 104), (104, 106))
    assert plan.token_ranges(1, 0, 1) == ()  # one token: rank 0 computes it
    assert build_transfer_plan(1, 1, 4).token_ranges(0, 3, 9) == ((3, 9),)
    with pytest.raises(ValueError, match="prefill_cp"):
        build_transfer_plan(1, 1, 4, prefill_cp=0)
