"""Request validation against the served model: every message says what to change."""

from __future__ import annotations

from engine.grammar import GrammarCompiler
from engine.sampling_params import SamplingParams
from orchestrator.config.checkpoint import ModelInfo
from orchestrator.router.detokenizer import Tokenizer
from orchestrator.router.request import GenerateInput, RequestError
from orchestrator.router.stop_text import MAX_STOP_STRINGS


def _invalid(message: str) -> RequestError:
    return RequestError("INVALID_ARGUMENT", message)


def validate_request(inp: GenerateInput, model: ModelInfo, tokenizer: Tokenizer | None,
                     grammars: GrammarCompiler | None = None) -> tuple[int, ...]:
    """Tokenize and check one request; returns the prompt token ids.

    Checks: a non-empty prompt; every id in [0, vocab_size); prompt + max_tokens <=
    max_model_len; :func:`check_sampling`; :func:`check_stops`. Ranges were checked when ``inp.sampling`` was built.

    Raises:
        RequestError: INVALID_ARGUMENT naming the problem and the fix.
    """
    if inp.token_ids is not None:
        ids = tuple(inp.token_ids)
    elif inp.text:
        if tokenizer is None:
            raise _invalid("this model has no tokenizer.json: send token_ids instead of text")
        nbytes = len(inp.text.encode())
        if nbytes > model.max_model_len * tokenizer.max_token_bytes:
            # NOTE: refused before tokenizing: it has more than max_model_len tokens for sure.
            raise _invalid(f"prompt is {nbytes} bytes, more than max_model_len "
                           f"{model.max_model_len} tokens can hold: shorten the prompt or "
                           "raise model.max_model_len")
        ids = tuple(tokenizer.encode(inp.text))
    else:
        ids = ()
    if not ids:
        raise _invalid("the prompt is empty: send non-empty text or at least one token id")
    bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise _invalid(f"token id {bad} is out of range [0, {model.vocab_size}) for "
                       f"{model.name}: send ids from this model's tokenizer")
    check_sampling(inp.sampling, model, grammars)
    check_stops(inp.stop, tokenizer)
    max_tokens = inp.sampling.max_tokens
    if len(ids) + max_tokens > model.max_model_len:
        raise _invalid(f"prompt has {len(ids)} tokens + max_tokens {max_tokens} > "
                       f"max_model_len {model.max_model_len}: shorten the prompt, lower "
                       "max_tokens or raise model.max_model_len")
    return ids


def check_sampling(sampling: SamplingParams, model: ModelInfo,
                   grammars: GrammarCompiler | None) -> None:
    """``stop_token_ids`` in [0, vocab_size); a grammar that llguidance accepts.

    Raises:
        RequestError: INVALID_ARGUMENT naming the problem (llguidance's message for grammars).
    """
    bad = next((t for t in sampling.stop_token_ids if t >= model.vocab_size), None)
    if bad is not None:
        raise _invalid(f"stop_token_ids: {bad} is out of range [0, {model.vocab_size}) for "
                       f"{model.name}")
    if sampling.grammar is None:
        return
    if grammars is None:
        raise _invalid("this model has no tokenizer.json: grammars (response_format, regex, "
                       "tools) need one")
    why = grammars.check(sampling.grammar)
    if why is not None:
        raise _invalid(f"the {sampling.grammar.kind} grammar cannot be used: {why}")


def check_stops(stops: tuple[str, ...], tokenizer: Tokenizer | None) -> None:
    """At most ``MAX_STOP_STRINGS`` non-empty stop strings, and a tokenizer to make text.

    Raises:
        RequestError: INVALID_ARGUMENT naming the problem.
    """
    if not stops:
        return
    if len(stops) > MAX_STOP_STRINGS:
        raise _invalid(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if any(not s for s in stops):
        raise _invalid(f"stop[{stops.index('')}] is empty: drop it (an empty stop string "
                       "would end every request at once)")
    if tokenizer is None:
        raise _invalid("this model has no tokenizer.json: stop strings need one; use "
                       "stop_token_ids instead")
