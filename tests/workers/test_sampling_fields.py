"""Per-request sampling fields through a real colocated rank, against references written here
from the formulas over HF transformers' logits (the tiny checkpoint, fp32): logprobs of greedy
steps equal log-softmax of HF's logits (1e-4); greedy with repetition / frequency / presence
penalties equals argmax of HF's logits penalized by the formulas; min_tokens and
stop_token_ids."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from orchestrator.tiny_model import write_tiny_checkpoint
from tests.workers.test_structured_output import colocated_rank, run_all

PROMPT = tuple(range(300, 317))
STEPS = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def rank(ckpt):
    yield from colocated_rank(ckpt)


@pytest.fixture(scope="module")
def hf(ckpt):
    return DeepseekV3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def hf_step_logits(hf, prompt, out) -> torch.Tensor:
    """HF's next-token logits before each token of ``out`` (one causal forward over
    ``prompt + out``, teacher-forced): ``[len(out), V]`` fp32."""
    with torch.no_grad():
        logits = hf(torch.tensor([list(prompt) + list(out)])).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(out)]


def penalized(x, prompt, out, rep, freq, pres):
    """The formulas, token by token: CTRL's repetition penalty over prompt + output, then
    OpenAI's frequency / presence penalties over the output."""
    x = x.clone()
    for t in set(prompt) | set(out):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(out):
        x[t] -= freq * out.count(t) + pres
    return x


def test_greedy_logprobs_equal_log_softmax_of_hf_logits(rank, hf):
    spec = RequestSpec("lp", PROMPT, SamplingParams(max_tokens=STEPS, ignore_eos=True,
                                                    logprobs=3))
    tokens, finish, error = run_all(rank, [spec], collect_logprobs=True)["lp"]
    assert error is None and finish == "length"
    refs = torch.log_softmax(hf_step_logits(hf, PROMPT, [t for t, _ in tokens]), dim=-1)
    for (token, lp), ref in zip(tokens, refs, strict=True):
        assert lp.token_id == token == int(ref.argmax())
        assert abs(lp.logprob - float(ref[token])) <= 1e-4
        vals, ids = torch.topk(ref, 3)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert max(abs(v - r) for (_, v), r in zip(lp.top, vals.tolist())) <= 1e-4


# NOTE: values that favour repeats: the random model's greedy output seldom repeats a token,
# so a penalty against repeats would not change it
@pytest.mark.parametrize("rep, freq, pres", [(0.7, 0.0, 0.0), (1.0, -1.5, 0.0),
                                             (1.0, 0.0, -2.0), (1.2, -1.0, -1.0)])
def test_greedy_with_penalties_equals_the_formulas(rank, hf, rep, freq, pres):
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True, repetition_penalty=rep,
                            frequency_penalty=freq, presence_penalty=pres)
    tokens, finish, error = run_all(rank, [RequestSpec("pen", PROMPT, params)])["pen"]
    assert error is None and finish == "length"
    for step, x in enumerate(hf_step_logits(hf, PROMPT, tokens)):
        want = int(penalized(x, PROMPT, tokens[:step], rep, freq, pres).argmax())
        assert tokens[step] == want, f"step {step}"
    plain = run_all(rank, [RequestSpec("plain", PROMPT, SamplingParams(
        max_tokens=STEPS, ignore_eos=True))])["plain"][0]
    assert tokens != plain, "the penalty changed nothing: the test cannot fail"


def test_min_tokens_masks_stop_ids_and_stop_token_ids_end_the_request(rank):
    plain = run_all(rank, [RequestSpec("p", PROMPT, SamplingParams(
        max_tokens=STEPS, ignore_eos=True))])["p"][0]
    stop_at = plain[3]
    first = plain.index(stop_at)
    got = run_all(rank, [RequestSpec("s", PROMPT, SamplingParams(
        max_tokens=STEPS, stop_token_ids=(stop_at,)))])["s"]
    assert got == (plain[:first + 1], "stop", None)
    held = run_all(rank, [RequestSpec("m", PROMPT, SamplingParams(
        max_tokens=STEPS, stop_token_ids=(stop_at,), min_tokens=first + 2))])["m"]
    assert stop_at not in held[0][:first + 2] and len(held[0]) >= first + 2
