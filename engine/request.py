"""The requests an instance schedules: :class:`RequestSpec` (what the router accepted) and
:class:`Request` (its state inside one instance: counters, not phases)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_pool import BlockSet
from engine.sampling_params import SamplingParams, TokenLogprobs
from engine.spec_decode import DraftInput

if TYPE_CHECKING:
    from engine.grammar import GrammarState


@dataclass(frozen=True)
class RequestSpec:
    """A validated, tokenized request as accepted by the router.

    ``prompt_token_ids``: at least one; ``sampling`` of a sampled request always carries a
    seed here; ``arrival_time``: ``time.time()`` when the router accepted it, seconds;
    ``num_resumed_tokens``: the last that many prompt tokens are output an earlier attempt
    already streamed (a migrated request, see docs/scaling.md): its sampling counts them
    (output token ``n`` of this spec is the request's token ``num_resumed_tokens + n``).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float = 0.0
    num_resumed_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus every token it may generate: the KV slots it may ever need."""
        return len(self.prompt_token_ids) + self.sampling.max_tokens



@dataclass
class Request:
    """One request inside an instance.

    Attributes:
        spec: the accepted request.
        output_token_ids: tokens generated so far (on decode, starts with prefill's token).
        num_computed_tokens: tokens whose KV is in this instance's cache.
        blocks: block table, or None while waiting for admission.
        num_cached_tokens: leading prompt tokens whose KV the prefix cache had at admission
            (never computed here).
        block_hashes: chained hashes of its full blocks known so far (engine/prefix_hash.py).
        num_hashed_blocks: leading blocks registered in the prefix cache.
        draft: speculative decoding: what the MTP module drafts from at the next step (set
            after each step that sampled), None otherwise.
        grammar: the request's grammar matcher on this instance (made on first use, replaying
            ``output_token_ids``), or None.
        output_logprobs: with ``sampling.logprobs`` set, one entry per token this instance
            sampled (the latest is what its token event carries).
    """

    spec: RequestSpec
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    blocks: BlockSet | None = None
    num_cached_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    draft: DraftInput | None = None
    grammar: GrammarState | None = None
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return self.spec.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.spec.num_prompt_tokens + len(self.output_token_ids)

    @property
    def sampling_step(self) -> int:
        """Which output token of the whole request the next sample is (seeds its draw):
        tokens streamed by earlier attempts plus those generated here."""
        return self.spec.num_resumed_tokens + len(self.output_token_ids)

    @property
    def generated_token_ids(self) -> list[int]:
        """Every output token of the whole request so far: what earlier attempts streamed
        (the prompt's last ``num_resumed_tokens``) then what this instance generated; the
        penalties and the grammar read this, so a migrated request keeps their state."""
        n = self.spec.num_resumed_tokens
        return [*self.spec.prompt_token_ids[-n:], *self.output_token_ids] if n else \
            self.output_token_ids

    @property
    def original_prompt_token_ids(self) -> tuple[int, ...]:
        """The client's prompt (without the tokens a migrated attempt resumes from)."""
        n = self.spec.num_resumed_tokens
        return self.spec.prompt_token_ids[:-n] if n else self.spec.prompt_token_ids

    def token_range(self, start: int, end: int) -> tuple[int, ...]:
        """Token ids at positions ``[start, end)`` of prompt + output."""
        prompt = self.spec.prompt_token_ids
        if end <= len(prompt):
            return tuple(prompt[start:end])
        return tuple((list(prompt) + self.output_token_ids)[start:end])
