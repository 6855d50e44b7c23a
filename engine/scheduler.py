"""Continuous-batching scheduler with chunked prefill, shared by all three instance roles.

Request state is counters (vLLM v1): each step schedules, per running request, the tokens it
still lacks KV for, capped by ``chunk_size`` and ``max_num_batched_tokens``; a step that brings
a request up to all its known tokens samples its next token. Roles differ only in a
:class:`RolePolicy`: prefill takes prompt blocks at admission and lets the request go after its
first token; decode receives the request with its blocks reserved, its prompt KV and first
token; colocated takes prompt + max_tokens blocks and runs to the end. NOTE: blocks are
reserved for a request's whole life at admission, so nothing is preempted.

Prefix cache (when the pool has one, engine/block_pool.py): admission reuses the cached blocks
of the prompt's longest cached prefix and the request starts at that length
(``num_cached_tokens``: neither computed nor written again); at most ``(prompt - 1) //
block_size`` blocks, so the last prompt token is always computed and its logits sampled. After
each step every block a request has filled is registered under its hash, prompt and output
alike (a conversation's next turn finds the previous one).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_pool import BlockPool, BlockSet
from engine.prefix_hash import block_hashes, reusable_blocks
from engine.runner import SeqStep
from engine.request import Request, RequestSpec


@dataclass(frozen=True)
class RolePolicy:
    """What differs between instance roles (legal combinations: see module docstring).

    Attributes:
        reserve_output_blocks: admission takes blocks for prompt + max_tokens (else prompt only).
        stop_after_first_token: a request leaves after its first sampled token (prefill role).
    """

    reserve_output_blocks: bool
    stop_after_first_token: bool


PREFILL = RolePolicy(reserve_output_blocks=False, stop_after_first_token=True)
DECODE = RolePolicy(reserve_output_blocks=True, stop_after_first_token=False)
COLOCATED = RolePolicy(reserve_output_blocks=True, stop_after_first_token=False)


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``[start, end)`` of one request computed this step, plus ``num_drafts`` MTP
    drafts after them (speculative decoding; they are verified in the same step)."""

    request: Request
    start: int
    end: int
    num_drafts: int = 0

    @property
    def completes(self) -> bool:
        """This step brings the request up to all its known tokens: it samples."""
        return self.end == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: the chunks to compute, in batch order."""

    chunks: tuple[ScheduledChunk, ...]
    speculative: bool = False

    @property
    def steps(self) -> list[SeqStep]:
        """The model runner's input for this step."""
        if self.speculative:
            return [_spec_step(c) for c in self.chunks]
        return [SeqStep(c.request.request_id, c.request.token_range(c.start, c.end), c.start,
                        c.request.blocks.block_ids) for c in self.chunks]

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


def _spec_step(c: ScheduledChunk) -> SeqStep:
    """A speculative step's :class:`SeqStep`: the draft input of a drafting chunk, the next
    token of a prompt chunk that has one (:mod:`engine.spec_forward`); a decoding chunk
    without drafts keeps its draft input (the MTP module still caches those rows)."""
    req = c.request
    nxt = req.token_range(c.end, c.end + 1)[0] if c.end < req.num_tokens else None
    d = req.draft
    decoding = c.end - c.start == 1 and nxt is None and d is not None \
        and d.start + len(d.token_ids) == c.start  # NOTE: its last token is this chunk's
    return SeqStep(req.request_id, req.token_range(c.start, c.end), c.start,
                   req.blocks.block_ids, draft=d if decoding else None,
                   num_drafts=c.num_drafts, next_token_id=nxt)


class Scheduler:
    """Chunked-prefill, continuous-batching scheduler of one instance (leader only).

    ``chunk_size``: most tokens of one request per step; ``max_num_batched_tokens``: per step;
    ``max_num_seqs``: requests running at once; ``num_speculative_tokens``: k MTP drafts per
    decoding request per step (0: off); its KV then needs k more slots than it keeps.

    ``admission`` (set by the rank; None: the pool is the whole budget): a runner's own
    per-request block budget checked and committed with the pool's, DeepSeek-V4's per KV
    group (:class:`engine.v4.admission.V4Admission`: ``scheduler_blocks(spec)``, ``need(tokens,
    step_tokens)``, ``refusal(need)``, ``pool_advice(role)``, ``can_admit(need)``,
    ``commit(block_set, need)``; its
    commitment goes back when the pool frees the set, through the pool's ``on_free``).
    """

    def __init__(self, pool: BlockPool, policy: RolePolicy, *, chunk_size: int,
                 max_num_batched_tokens: int, max_num_seqs: int,
                 num_speculative_tokens: int = 0) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.pool = pool
        self.policy = policy
        self.chunk_size = chunk_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.admission = None

    def blocks_for(self, spec: RequestSpec) -> int:
        """Blocks a request takes at admission under this role (with an ``admission``: what
        it says the request's slots carry)."""
        if self.admission is not None:
            return self.admission.scheduler_blocks(spec)
        tokens = spec.max_total_tokens if self.policy.reserve_output_blocks else \
            spec.num_prompt_tokens
        # NOTE: verify rows of drafts past the kept tokens are written, then overwritten
        extra = self.num_speculative_tokens if self.policy.reserve_output_blocks else 0
        return self.pool.blocks_needed(tokens + extra)

    def admission_need(self, spec: RequestSpec) -> dict[str, int] | None:
        """What ``spec`` commits in the ``admission`` budget (None without one): its most
        blocks per group over its life here (prompt on prefill, prompt + max_tokens else),
        ``chunk_size`` tokens a step."""
        if self.admission is None:
            return None
        tokens = spec.max_total_tokens if self.policy.reserve_output_blocks else \
            spec.num_prompt_tokens
        return self.admission.need(tokens, self.chunk_size)

    def admission_free(self) -> dict[str, int] | None:
        """Blocks per group the ``admission`` budget still has for new requests (DeepSeek-V4's
        group pools, :meth:`engine.v4.admission.V4Admission.uncommitted`); None without one."""
        return None if self.admission is None else self.admission.uncommitted()

    def pool_advice(self, role: str) -> str:
        """What to change when one request needs more blocks than this pool has in all
        (``role``: ``prefill``, ``decode`` or ``colocated``): the ``admission``'s advice
        (DeepSeek-V4 PD: the staging pool's key), else a shorter request or more
        ``num_kv_blocks``."""
        if self.admission is not None:
            return self.admission.pool_advice(role)
        return "shorten the prompt or max_tokens, or raise num_kv_blocks"

    def refusal(self, spec: RequestSpec) -> str | None:
        """Why the ``admission`` budget can never admit ``spec`` (None: it can, or none)."""
        need = self.admission_need(spec)
        return None if need is None else self.admission.refusal(need)

    def prefix_hashes(self, req: Request) -> list[int]:
        """Hashes of the prompt blocks a prefix-cache hit may cover: the first
        ``(prompt - 1) // block_size`` (the last prompt token is always computed); empty with
        the cache off."""
        if not self.pool.caching:
            return []
        return self._hashes(req, reusable_blocks(req.num_prompt_tokens, self.pool.block_size))

    def allocate(self, req: Request) -> BlockSet | None:
        """Check-then-commit: give ``req`` its admission blocks (its cached prefix reused,
        ``num_computed_tokens = num_cached_tokens`` = that prefix), or None when they do not
        fit now. Caller holds the leader's lock."""
        need, hashes = self.blocks_for(req.spec), self.prefix_hashes(req)
        extra = self.admission_need(req.spec)
        if not self.pool.can_allocate(need, hashes) or \
                (extra is not None and not self.admission.can_admit(extra)):
            return None
        req.blocks = self.pool.allocate(need, hashes)
        if extra is not None:
            self.admission.commit(req.blocks, extra)
        req.num_cached_tokens = req.num_computed_tokens = \
            req.blocks.num_cached * self.pool.block_size
        if self.pool.caching:
            self.pool.note_lookup(req.num_prompt_tokens, req.num_cached_tokens)
        return req.blocks

    def cache_computed(self, req: Request) -> None:
        """Register every block ``req`` has filled with KV (``num_computed_tokens``) and not
        registered yet in the prefix cache; no-op with the cache off."""
        if not self.pool.caching or req.blocks is None:
            return
        first = max(req.num_hashed_blocks, req.blocks.num_cached)
        full = min(req.num_computed_tokens // self.pool.block_size, len(req.blocks))
        if full > first:
            self.pool.cache_blocks(req.blocks, first, self._hashes(req, full)[first:full])
            req.num_hashed_blocks = full

    def _hashes(self, req: Request, num_blocks: int) -> list[int]:
        """The hashes of ``req``'s first ``num_blocks`` blocks (kept on the request)."""
        if len(req.block_hashes) < num_blocks:
            bs = self.pool.block_size
            req.block_hashes = block_hashes(req.token_range(0, num_blocks * bs), bs,
                                            self.pool.salt, req.block_hashes)
        return req.block_hashes[:num_blocks]

    def add(self, request: Request) -> None:
        """Queue a request; one that already holds blocks (decode) runs from the next step
        (its filled blocks are registered in the prefix cache now)."""
        if request.blocks is not None:
            self.running.append(request)
            self.cache_computed(request)
        else:
            self.waiting.append(request)

    def find(self, request_id: str) -> Request | None:
        for req in (*self.running, *self.waiting):
            if req.request_id == request_id:
                return req
        return None

    def remove(self, request_id: str, *, free: bool = True) -> Request | None:
        """Take a request out (finish or abort).

        With ``free`` its blocks go back to the pool now (exactly once); without, the caller
        owns ``request.blocks`` and frees them later (prefill, while KV sends drain).
        """
        req = self.find(request_id)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        if free and req.blocks is not None:
            self.pool.free(req.blocks)
            req.blocks = None
        return req

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            if self.allocate(self.waiting[0]) is None:
                return  # FIFO: no overtaking, so a big request is not starved
            self.running.append(self.waiting.popleft())

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first (decodes are 1 token), FIFO, within budget."""
        self._admit()
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        # NOTE: decodes (1 token) go first, then prefill chunks in admission order (stable sort).
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            todo = req.num_tokens - req.num_computed_tokens
            n = min(todo, self.chunk_size, budget)
            if n <= 0:
                continue
            drafts = self._num_drafts(req, todo, budget)
            chunks.append(ScheduledChunk(req, req.num_computed_tokens,
                                         req.num_computed_tokens + n, drafts))
            budget -= n + drafts
        return SchedulerOutput(tuple(chunks), self.num_speculative_tokens > 0)

    def _num_drafts(self, req: Request, todo: int, budget: int) -> int:
        """Drafts a decoding request makes this step: up to k, never past ``max_tokens``."""
        if not self.num_speculative_tokens or todo != 1 or req.draft is None:
            return 0
        left = req.spec.sampling.max_tokens - len(req.output_token_ids) - 1
        return max(0, min(self.num_speculative_tokens, left, budget - 1))

    def update(self, output: SchedulerOutput, sampled: dict[str, int],
               accepted: dict[str, tuple[int, ...]] | None = None) -> None:
        """Advance counters after ``output`` ran; ``sampled`` (request id -> token id, for
        the chunks that ``completes``) appends each token to its request, after the drafts
        ``accepted`` for it (speculative decoding: their KV is kept, the rest rolled back)."""
        accepted = accepted or {}
        for chunk in output.chunks:
            rid = chunk.request.request_id
            kept = accepted.get(rid, ())
            chunk.request.num_computed_tokens = chunk.end + len(kept)
            chunk.request.output_token_ids.extend(kept)
            if rid in sampled:
                chunk.request.output_token_ids.append(sampled[rid])
            self.cache_computed(chunk.request)

    @property
    def num_outstanding_tokens(self) -> int:
        """Tokens still to compute or generate across queued and running requests."""
        return sum(r.spec.max_total_tokens - r.num_computed_tokens
                   for r in (*self.running, *self.waiting))


def finish_reason(req: Request, eos_token_ids: frozenset[int]) -> str | None:
    """Why ``req`` stops after its latest token, or None to keep going.

    "length" once ``max_tokens`` tokens exist; "stop" when the latest token is an EOS id and the
    request does not ``ignore_eos``, or one of its ``stop_token_ids``.
    """
    if not req.output_token_ids:
        return None
    if len(req.output_token_ids) >= req.spec.sampling.max_tokens:
        return "length"
    last = req.output_token_ids[-1]
    if not req.spec.sampling.ignore_eos and last in eos_token_ids:
        return "stop"
    if last in req.spec.sampling.stop_token_ids:
        return "stop"
    return None
