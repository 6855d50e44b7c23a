"""Sampler: greedy, top-k/top-p filtering, per-request seeds independent of the batch."""

import pytest
import torch

from engine.sampling import RowFailure, greedy_and_finite, greedy_argmax, sample
from engine.sampling_params import SAMPLING_EPS, SamplingParams, fill_seed


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    assert sample(logits, [SamplingParams()] * 2, [0, 0]) == [1, 0]


def test_seeded_draw_ignores_batch_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits[2:3], [p], [k])[0] for k in range(8)]
    batched = [sample(logits, [SamplingParams(temperature=0.7, seed=9), SamplingParams(),
                               p, SamplingParams(temperature=1.0, seed=5)], [k] * 4)[2]
               for k in range(8)]
    assert alone == batched
    assert len(set(alone)) > 1  # it really samples


def test_top_k_one_and_tiny_top_p_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(3, 500)
    greedy = sample(logits, [SamplingParams()] * 3, [0] * 3)
    k1 = sample(logits, [SamplingParams(temperature=2.0, top_k=1, seed=s) for s in range(3)],
                [0] * 3)
    p0 = sample(logits, [SamplingParams(temperature=2.0, top_p=1e-6, seed=s) for s in range(3)],
                [0] * 3)
    assert k1 == greedy == p0


def test_top_k_restricts_support():
    logits = torch.arange(100, dtype=torch.float32)[None]
    draws = {sample(logits, [SamplingParams(temperature=50.0, top_k=3, seed=s)], [0])[0]
             for s in range(200)}
    assert draws == {97, 98, 99}


# NOTE: probabilities 0.35, 0.25, 0.2, 0.12, 0.08: running sums 0.35, 0.6, 0.8, 0.92, 1.0, each
# at least 0.02 from the p tested below, so fp32 rounding cannot move the nucleus edge.
NUCLEUS_PROBS = (0.35, 0.25, 0.2, 0.12, 0.08)


def _draws(logits: torch.Tensor, top_p: float, n: int = 300) -> set[int]:
    """Tokens of ``n`` seeded draws (seeds and steps vary) at temperature 1."""
    return {sample(logits[None], [SamplingParams(temperature=1.0, top_p=top_p, seed=s)],
                   [s % 7])[0] for s in range(n)}


@pytest.mark.parametrize("top_p, nucleus", [(0.5, {0, 1}), (0.7, {0, 1, 2}),
                                            (0.9, {0, 1, 2, 3}), (0.95, {0, 1, 2, 3, 4})])
def test_top_p_draws_exactly_the_nucleus(top_p, nucleus):
    """The nucleus is the smallest set of most likely tokens whose probabilities sum to at
    least p (by hand: p 0.5 -> 0.35 + 0.25; p 0.9 -> 0.35 + 0.25 + 0.2 + 0.12). Every draw is
    in it and every token of it is drawn."""
    order = [3, 0, 4, 1, 2]  # token ids of NUCLEUS_PROBS: the filter must sort by probability
    logits = torch.empty(5)
    logits[order] = torch.tensor(NUCLEUS_PROBS).log()
    assert _draws(logits, top_p) == {order[i] for i in nucleus}


def test_top_p_at_exactly_the_running_sum_keeps_no_more_tokens():
    """Four equal logits (probabilities exactly 0.25 in fp32): the first two reach p = 0.5
    exactly, so the nucleus has two tokens (the rule: drop a token once the mass before it
    reaches p); just above 0.5 it has three. Ties may keep any of the tied tokens."""
    logits = torch.zeros(4)
    assert len(_draws(logits, 0.5)) == 2
    assert len(_draws(logits, 0.5 + 1e-6)) == 3
    assert len(_draws(logits, 1.0)) == 4


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"), ({"seed": -1}, "seed"),
    ({"temperature": float("nan")}, "temperature")])
def test_bad_values_say_what_is_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_fill_seed_only_for_sampled_requests():
    assert fill_seed(SamplingParams()).seed is None
    assert fill_seed(SamplingParams(temperature=1.0, seed=3)).seed == 3
    assert fill_seed(SamplingParams(temperature=1.0)).seed is not None


def test_temperature_below_eps_is_greedy():
    """1e-38 once overflowed the scaled logits to inf and the probabilities to NaN."""
    torch.manual_seed(2)
    logits = torch.randn(3, 300) * 30
    greedy = sample(logits, [SamplingParams()] * 3, [0] * 3)
    tiny = [SamplingParams(temperature=t, seed=1) for t in (1e-38, 5e-324, SAMPLING_EPS / 2)]
    assert all(p.greedy for p in tiny) and not SamplingParams(temperature=SAMPLING_EPS).greedy
    assert sample(logits, tiny, [0] * 3) == greedy
    assert fill_seed(SamplingParams(temperature=1e-38)).seed is None


def test_every_valid_value_samples_a_token():
    torch.manual_seed(3)
    logits = torch.randn(5, 400) * 50
    params = [SamplingParams(temperature=SAMPLING_EPS, seed=1),
              SamplingParams(temperature=1e38, seed=2),
              SamplingParams(temperature=3.0, top_p=5e-324, seed=3),
              SamplingParams(temperature=0.5, top_k=2**31 - 1, seed=4),
              SamplingParams(temperature=1.0, top_k=1, top_p=1e-9, seed=2**63 - 1)]
    out = sample(logits, params, [0] * 5)
    assert all(isinstance(t, int) and 0 <= t < 400 for t in out), out
    assert out[2] == int(logits[2].argmax()) and out[4] == int(logits[4].argmax())


def test_a_poisoned_row_fails_alone():
    torch.manual_seed(4)
    logits = torch.randn(4, 50)
    clean = sample(logits, [SamplingParams(), SamplingParams(temperature=1.0, seed=7)] * 2,
                   [0] * 4)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[3] = 3e34  # finite, but over fp32 once scaled by 1 / SAMPLING_EPS
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=7), SamplingParams(),
              SamplingParams(temperature=SAMPLING_EPS, seed=7)]
    out = sample(logits, params, [0] * 4)
    assert out[0] == clean[0]
    assert [type(t) for t in out[1:]] == [RowFailure] * 3
    assert "non-finite logits" in out[1].reason and "not finite" in out[3].reason


@pytest.mark.parametrize("vocab", [7, 256, 511, 512, 1000, 129280])
def test_greedy_argmax_equals_torch_argmax_with_ties(vocab):
    """The chunked argmax picks what torch.argmax picks, the first index on ties, with
    vocabularies shorter than a chunk, a whole number of chunks and a short last chunk."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    logits[1] = 0.0  # every column ties: index 0
    logits[2, vocab // 3] = logits[2, vocab - 1] = 50.0  # a tie across chunks: the first
    logits[3, vocab - 1] = 50.0  # the max in the (short) last chunk
    logits[4] = float("-inf")
    logits[4, vocab // 2] = -1e30
    logits[5, : vocab // 2] = float("-inf")
    assert greedy_argmax(logits).tolist() == torch.argmax(logits, dim=-1).tolist()
    assert greedy_argmax(logits[:0]).shape == (0,)


@pytest.mark.parametrize("vocab", [300, 129280])  # NOTE: the per-row-sum path, the chunked one
def test_greedy_and_finite_equals_argmax_and_the_row_check(vocab):
    """One host read gives what torch.argmax and the row check (no NaN, no +inf, some finite
    logit) give, row by row: clean rows, masked rows (-inf), poisoned rows; ids compared on
    the rows that pass."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=gen)
    logits[1, vocab // 2] = float("nan")
    logits[2, vocab - 1] = float("inf")
    logits[3] = float("-inf")  # every token masked
    logits[4, : vocab - 3] = float("-inf")  # masked but for the last three
    logits[5, 7] = float("nan")
    logits[5, 9] = float("-inf")
    logits[6, vocab // 3] = logits[6, vocab - 2] = 40.0  # a tie: the first
    ids, finite = greedy_and_finite(logits)
    want = [not bool(torch.isnan(r).any()) and not bool(torch.isposinf(r).any())
            and bool(torch.isfinite(r).any()) for r in logits]
    assert finite == want == [True, False, False, False, True, False, True, True]
    ref = torch.argmax(logits, dim=-1).tolist()
    assert [i for i, ok in zip(ids, finite) if ok] == [i for i, ok in zip(ref, want) if ok]
    assert all(type(i) is int for i in ids)
    assert greedy_and_finite(logits[:0]) == ([], [])
