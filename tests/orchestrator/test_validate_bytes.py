"""A text prompt too long for max_model_len is refused from its byte length, before the
(possibly seconds-long) tokenization."""

import dataclasses
import time

import pytest

from engine.sampling_params import SamplingParams
from orchestrator.router.request import GenerateInput, RequestError
from orchestrator.router.validate import validate_request
from tests.orchestrator.harness import MODEL, TOKENIZER


def test_huge_text_is_refused_without_tokenizing():
    text = "a b " * 1_000_000  # 4 MB, ~2M tokens
    calls = []
    real_encode = TOKENIZER.encode
    TOKENIZER.encode = lambda t: calls.append(t) or real_encode(t)
    try:
        start = time.monotonic()
        with pytest.raises(RequestError, match="bytes, more than max_model_len"):
            validate_request(GenerateInput(text=text, token_ids=None, sampling=SamplingParams(max_tokens=4)),
                             MODEL, TOKENIZER)
        assert time.monotonic() - start < 1.0 and calls == []
    finally:
        TOKENIZER.encode = real_encode


def test_bound_never_refuses_a_text_that_fits():
    # the longest token's bytes, max_model_len - 1 times, is <= the bound: tokenized, not refused
    longest = max(TOKENIZER._tok.get_vocab(False), key=lambda t: len(t.encode()))
    assert TOKENIZER.max_token_bytes >= len(longest.encode())
    ids = validate_request(GenerateInput(text="hello world", token_ids=None,
                                           sampling=SamplingParams(max_tokens=4)),
                           MODEL, TOKENIZER)
    assert len(ids) >= 2


@pytest.mark.parametrize("sampling", [SamplingParams(max_tokens=4, presence_penalty=0.5),
                                      SamplingParams(max_tokens=4, min_tokens=2),
                                      SamplingParams(max_tokens=4, logprobs=1)])
def test_logits_processing_is_served_under_speculative_decoding(sampling):
    # the MTP verify step processes each row (rank/spec_verify.py): accepted as without MTP
    inp = GenerateInput(text=None, token_ids=[1, 2, 3], sampling=sampling)
    mtp = dataclasses.replace(MODEL, num_speculative_tokens=1)
    assert validate_request(inp, MODEL, TOKENIZER) == validate_request(inp, mtp, TOKENIZER)
