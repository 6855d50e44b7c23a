"""Grammar-constrained decoding: one llguidance matcher per request, held by the leader that
samples it.

llguidance (Microsoft's Rust engine behind Guidance) computes the set of tokens that keep the
output inside a JSON Schema, regex or Lark grammar on the CPU in tens of microseconds per token,
without torch (docs/router.md says why it was chosen). Its state is the tokens consumed so far,
so a request's grammar state "travels" from prefill to decode as its output tokens: a leader
that meets the request for the first time (decode after prefill sampled token 0) starts a fresh
matcher and replays them (:meth:`GrammarState.catch_up`). No torch here: the router checks
grammars with the same code before it accepts a request.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

import llguidance
import numpy as np

from engine.sampling_params import GrammarSpec

# NOTE: the parser's own bounds keep one pathological grammar from stalling a step.
PARSER_LIMITS = llguidance.LLParserLimits(max_items_in_row=2000, step_max_items=50_000)
CACHED_GRAMMARS = 64  # fresh matchers kept per compiler: a repeated grammar is copied, not built


def grammar_text(spec: GrammarSpec) -> str:
    """``spec`` as llguidance's grammar text (a JSON schema must be a JSON object).

    Raises:
        ValueError: a JSON schema that is not JSON (the message says where).
    """
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.loads(spec.source), defaults={"whitespace_flexible": False})
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    return llguidance.LLMatcher.grammar_from_lark(spec.source)


class GrammarCompiler:
    """The tokenizer side of llguidance for one checkpoint, built on first use (~1 s).

    Args:
        tokenizer_json: path of the checkpoint's tokenizer.json.
        vocab_size: the model's logits width ``V`` (>= the tokenizer's vocabulary).
        eos_token_ids: the ids that end a request; the first is what a finished grammar allows.
    """

    def __init__(self, tokenizer_json: str | Path, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.path, self.vocab_size = Path(tokenizer_json), vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._fresh: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self.path.read_text(), n_vocab=self.vocab_size,
                    eos_token=list(self.eos_token_ids) or None)
            return self._tokenizer

    def check(self, spec: GrammarSpec) -> str | None:
        """Why ``spec`` cannot be used (llguidance's message), or None when it can."""
        try:
            text = grammar_text(spec)
        except ValueError as exc:
            return f"the {spec.kind} is not valid JSON: {exc}"
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self.tokenizer, limits=PARSER_LIMITS)
        if is_error:
            return messages[0]
        first = self.start(spec).matcher  # a copy: computing its mask changes nothing cached
        allowed = {i for i, bias in enumerate(first.compute_logit_bias()) if bias}
        if first.is_error() or not allowed - set(self.eos_token_ids):
            return (f"the {spec.kind} allows no output at all (e.g. a schema that only refers "
                    "to itself): give it at least one value it accepts")
        return None

    def start(self, spec: GrammarSpec) -> GrammarState:
        """A fresh matcher for ``spec`` (a copy of a cached one when ``spec`` was seen lately).

        Raises:
            ValueError: the grammar is invalid (llguidance's message).
        """
        fresh = self._fresh.get(spec)
        if fresh is None:
            fresh = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0,
                                         limits=PARSER_LIMITS)
            if fresh.is_error():
                raise ValueError(f"the {spec.kind} grammar is invalid: {fresh.get_error()}")
            self._fresh[spec] = fresh
            while len(self._fresh) > CACHED_GRAMMARS:
                self._fresh.popitem(last=False)
        self._fresh.move_to_end(spec)
        return GrammarState(fresh.deep_copy(), self.vocab_size)


class GrammarState:
    """One request's matcher and how many of its output tokens it has consumed.

    Interface for every sampler stage that masks (plain decode, and speculative drafts):
    :meth:`catch_up` with the request's output so far, then :meth:`fill_bitmask` gives the
    mask of the next token; drafts are checked with :meth:`accepts_prefix` (no state change).
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self.consumed = 0

    def catch_up(self, output_token_ids: list[int]) -> str | None:
        """Consume the output tokens not consumed yet; returns why the matcher refused one
        (the request then fails), else None."""
        new = output_token_ids[self.consumed:]
        if new and not self.matcher.is_stopped():
            self.matcher.consume_tokens(new)
        self.consumed = len(output_token_ids)
        if self.matcher.is_error():
            return f"the output left its grammar: {self.matcher.get_error()}"
        return None

    def fill_bitmask(self, address: int, nbytes: int) -> None:
        """Write the next token's mask as bits (bit ``t % 32`` of int32 word ``t // 32``: 1 =
        allowed) into ``nbytes`` bytes at ``address`` (``(V + 31) // 32`` int32 words). Drops
        the GIL (runs beside the model's forward, :mod:`engine.logits_process`)."""
        self.matcher.unsafe_compute_mask_ptr(address, nbytes)

    def draft_bitmasks(self, drafts: list[int], words: int) -> np.ndarray:
        """``[m, words]`` int32 next-token masks (as :meth:`fill_bitmask`) after each of the
        first m drafts, m = how many in a row the grammar accepts: row i is the mask once
        ``drafts[:i + 1]`` follow the consumed output. The drafts are consumed, then rolled
        back: the state does not change."""
        m = self.accepts_prefix(drafts)
        bits = np.zeros((m, words), dtype=np.int32)
        for i in range(m):
            self.matcher.consume_token(drafts[i])
            self.fill_bitmask(bits[i].ctypes.data, words * 4)
        if m:
            self.matcher.rollback(m)
        return bits

    def accepts_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (drafts after the consumed output) the grammar accepts in a
        row; the state does not change."""
        return self.matcher.validate_tokens(tokens)
