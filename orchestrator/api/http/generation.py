"""One OpenAI request on the router: the same ``Router.generate`` the gRPC servicer calls
(which applies the stop strings), with OpenAI's sampling defaults on top; ``n`` choices are
``n`` router requests of the same tokenized prompt (``orchestrator.router.fan_out``, as gRPC's;
its KV is computed once per choice unless the instances' prefix cache holds it).

The prompt is tokenized here (off the loop, with the checkpoint's tokenizer) so its token
count gives chat's default ``max_tokens`` (the rest of ``max_model_len``) and ``usage`` when a
stop string ends early; a text the router must refuse anyway goes to it as text and gets
gRPC's message.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from engine.sampling_params import GrammarSpec, TokenLogprobs
from orchestrator.api.convert import build_sampling
from orchestrator.api.http.openai_schema import GenerationRequest
from orchestrator.router.fan_out import choice_inputs
from orchestrator.router.request import GenerateInput
from orchestrator.router.router import Router

OPENAI_TEMPERATURE = 1.0  # OpenAI's default when a request gives none
OPENAI_TOP_P = 1.0


@dataclass(frozen=True)
class Piece:
    """New text of the choice (and, when asked, the logprobs of the tokens it came from);
    the last piece has the finish reason."""

    text: str
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()


class Generation:
    """One request's run: :meth:`pieces` streams it, then the counters hold its usage.

    Attributes:
        request_id: the router's id of it (``"<response_id>:<i>"`` for choice i of n > 1).
        response_id: the HTTP request's id, the response id's suffix (one for all n choices).
        prompt_tokens, completion_tokens: usage (completion counts every generated token,
            the ones a stop string cut off included, as OpenAI does).
        cached_tokens: prompt tokens found in the prefix cache (from the last chunk's stats).
    """

    def __init__(self, router: Router, inp: GenerateInput, prompt_tokens: int,
                 response_id: str) -> None:
        self.router, self.inp = router, inp
        self.request_id, self.response_id = inp.request_id, response_id
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0
        self.cached_tokens = 0

    async def pieces(self) -> AsyncIterator[Piece]:
        """The choice's text as it is generated; the last piece has finish_reason "stop"
        (EOS or a stop string), "length" or "abort". Leaving early (the client gone) closes the router's stream, which aborts the request on every instance.

        Raises:
            RequestError: the router's (bad input, overload, failures; see Router.generate).
        """
        stream = self.router.generate(self.inp)
        try:
            async for chunk in stream:
                self.completion_tokens += len(chunk.token_ids)
                if chunk.stats is not None:
                    self.prompt_tokens = chunk.stats.prompt_tokens
                    self.cached_tokens = chunk.stats.cached_tokens
                if chunk.finish_reason is not None:
                    yield Piece(chunk.text, chunk.finish_reason, chunk.logprobs)
                    return
                if chunk.text or chunk.logprobs:
                    yield Piece(chunk.text, None, chunk.logprobs)
        finally:
            await stream.aclose()


async def start_generation(router: Router, text: str | None, token_ids: tuple[int, ...] | None,
                           req: GenerationRequest, max_tokens: int | None,
                           grammar: GrammarSpec | None = None) -> list[Generation]:
    """``req.n`` :class:`Generation` s of one prompt (exactly one of ``text`` /
    ``token_ids``), tokenized once; choice i of a seeded request is seeded ``seed + i``.

    ``max_tokens`` None fills the context (``max_model_len`` minus the prompt).

    Raises:
        RequestError: INVALID_ARGUMENT for sampling values gRPC would refuse (same message).
    """
    if text is not None:
        token_ids = await _tokenize(router, text)
    prompt_tokens = len(token_ids) if token_ids is not None else 0
    if max_tokens is None:
        max_tokens = max(router.model.max_model_len - prompt_tokens, 1)
    sampling = build_sampling(
        max_tokens=max_tokens,
        temperature=OPENAI_TEMPERATURE if req.temperature is None else req.temperature,
        top_k=req.top_k or 0, top_p=OPENAI_TOP_P if req.top_p is None else req.top_p,
        seed=req.seed, ignore_eos=bool(req.ignore_eos),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_tokens=req.min_tokens or 0, stop_token_ids=tuple(req.stop_token_ids or ()),
        logprobs=req.top_logprobs_count, grammar=grammar)
    inp = GenerateInput(text=text if token_ids is None else None, token_ids=token_ids,
                        sampling=sampling, request_id=uuid.uuid4().hex,
                        stop=req.stop_strings())
    return [Generation(router, choice, prompt_tokens, inp.request_id)
            for choice in choice_inputs(inp, req.choices)]


async def _tokenize(router: Router, text: str) -> tuple[int, ...] | None:
    """The prompt's ids, or None when the router must see (and refuse) the text itself."""
    tokenizer = router.tokenizer
    if tokenizer is None or not text:
        return None
    if len(text.encode()) > router.model.max_model_len * tokenizer.max_token_bytes:
        return None
    return tuple(await asyncio.to_thread(tokenizer.encode, text))
