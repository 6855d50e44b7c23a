"""Continuous-batching scheduler with chunked prefill, shared by all three instance roles.

Request state is counters (vLLM v1): each step schedules, per running request, the tokens it
still lacks KV for, capped by ``chunk_size`` and ``max_num_batched_tokens``; a step that brings
a request up to all its known tokens samples its next token. Roles differ only in a
:class:`RolePolicy`: prefill takes prompt blocks at admission and lets the request go after its
first token; decode receives the request with its blocks reserved, its prompt KV and first
token; colocated takes prompt + max_tokens blocks and runs to the end. NOTE: blocks are
reserved for a request's whole life at admission, so nothing is preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_pool import BlockPool
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
    """Tokens ``[start, end)`` of one request computed this step."""

    request: Request
    start: int
    end: int

    @property
    def completes(self) -> bool:
        """This step brings the request up to all its known tokens: it samples."""
        return self.end == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: the chunks to compute, in batch order."""

    chunks: tuple[ScheduledChunk, ...]

    @property
    def steps(self) -> list[SeqStep]:
        """The model runner's input for this step."""
        return [SeqStep(c.request.request_id, c.request.token_range(c.start, c.end), c.start,
                        c.request.blocks.block_ids) for c in self.chunks]

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    """Chunked-prefill, continuous-batching scheduler of one instance (leader only).

    ``chunk_size``: most tokens of one request per step; ``max_num_batched_tokens``: per step;
    ``max_num_seqs``: requests running at once.
    """

    def __init__(self, pool: BlockPool, policy: RolePolicy, *, chunk_size: int,
                 max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.pool = pool
        self.policy = policy
        self.chunk_size = chunk_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def blocks_for(self, spec: RequestSpec) -> int:
        """Blocks a request takes at admission under this role."""
        tokens = spec.max_total_tokens if self.policy.reserve_output_blocks else \
            spec.num_prompt_tokens
        return self.pool.blocks_needed(tokens)

    def add(self, request: Request) -> None:
        """Queue a request; one that already holds blocks (decode) runs from the next step."""
        if request.blocks is not None:
            self.running.append(request)
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
            need = self.blocks_for(self.waiting[0].spec)
            if not self.pool.can_allocate(need):
                return  # FIFO: no overtaking, so a big request is not starved
            req = self.waiting.popleft()
            req.blocks = self.pool.allocate(need)
            self.running.append(req)

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
            chunks.append(ScheduledChunk(req, req.num_computed_tokens,
                                         req.num_computed_tokens + n))
            budget -= n
        return SchedulerOutput(tuple(chunks))

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Advance counters after ``output`` ran; ``sampled`` (request id -> token id, for
        the chunks that ``completes``) appends each token to its request."""
        for chunk in output.chunks:
            chunk.request.num_computed_tokens = chunk.end
            if chunk.request.request_id in sampled:
                chunk.request.output_token_ids.append(sampled[chunk.request.request_id])

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
