"""Sampler: greedy, top-k/top-p filtering, per-request seeds independent of the batch."""

import pytest
import torch

from engine.sampling import sample
from engine.sampling_params import SamplingParams, fill_seed


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
