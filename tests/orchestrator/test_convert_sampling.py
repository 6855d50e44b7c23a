"""Every sampling field crosses gRPC both ways (orchestrator/api/convert.py), logprobs come
back on the response, and bad values are INVALID_ARGUMENT with SamplingParams' message."""

from __future__ import annotations

import pytest

from engine.sampling_params import GrammarSpec, SamplingParams, TokenLogprobs
from orchestrator.api.convert import (chunk_from_proto, chunk_to_proto, sampling_from_proto,
                                      sampling_to_proto)
from orchestrator.api.rpc import orch_pb2 as pb
from orchestrator.router.request import OutputChunk, RequestError


@pytest.mark.parametrize("grammar", [None, GrammarSpec("json_schema", '{"type": "object"}'),
                                     GrammarSpec("regex", "[a-z]+"),
                                     GrammarSpec("lark", 'start: "x"')])
def test_sampling_round_trips_through_proto(grammar):
    # NOTE: values fp32 holds exactly (proto floats are fp32)
    params = SamplingParams(max_tokens=9, temperature=0.75, top_k=5, top_p=0.875, seed=3,
                            presence_penalty=0.5, frequency_penalty=-1.0,
                            repetition_penalty=1.25, min_tokens=2, stop_token_ids=(7, 8),
                            logprobs=4, grammar=grammar)
    back = sampling_from_proto(pb.SamplingParams.FromString(
        sampling_to_proto(params).SerializeToString()))
    assert back == params


def test_unset_fields_are_off_and_bad_ones_are_refused():
    off = sampling_from_proto(pb.SamplingParams(max_tokens=4))
    assert (off.repetition_penalty, off.logprobs, off.grammar, off.processed) == \
        (1.0, None, None, False)
    with pytest.raises(RequestError, match="presence_penalty must be in"):
        sampling_from_proto(pb.SamplingParams(max_tokens=4, presence_penalty=3))
    with pytest.raises(RequestError, match="sampling.grammar is set but empty"):
        sampling_from_proto(pb.SamplingParams(max_tokens=4, grammar=pb.Grammar()))
    with pytest.raises(RequestError, match="ignore_eos cannot go with a grammar"):
        sampling_from_proto(pb.SamplingParams(max_tokens=4, ignore_eos=True,
                                              grammar=pb.Grammar(regex="a")))


def test_logprobs_come_back_on_the_response():
    lps = (TokenLogprobs(5, -0.25, ((5, -0.25), (9, -2.0))), TokenLogprobs(6, -1.5))
    chunk = OutputChunk("r", (5, 6), "ab", logprobs=lps)
    back = chunk_from_proto(pb.GenerateResponse.FromString(
        chunk_to_proto(chunk).SerializeToString()))
    assert back.logprobs == lps
