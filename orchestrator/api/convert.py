"""The one place protobuf meets the dataclasses (rank.messages, orchestrator.router.request).

Proto conventions kept here only: ``top_p`` 0 means 1.0 (off); ``temperature`` 0 is greedy;
``top_k`` 0 is off; ``repetition_penalty`` 0 means 1.0 (off); ``seed`` and ``logprobs`` are
optional; ``n`` 0 means 1; ``sampling.stop`` travels as ``GenerateInput.stop`` (the router
applies it, not the engine). On the way in, every client-supplied field is
checked: request_id (``orchestrator.router.limits``), sampling (``SamplingParams``); prompt lengths
and token ids against the model in ``orchestrator.router.validate``.
"""

from __future__ import annotations

from typing import Any

from engine.sampling_params import GrammarSpec, SamplingParams, TokenLogprobs
from rank.messages import InstanceStatusInfo, KVTailStats
from rank.step_timing import PhaseTiming, StepTimings
from orchestrator.router.fan_out import choice_inputs
from orchestrator.router.limits import check_request_id
from orchestrator.router.request import GenerateInput, OutputChunk, RequestError, RequestStats
from orchestrator.api.rpc import orch_pb2 as pb
from orchestrator.status import InstanceView


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Proto sampling -> :class:`SamplingParams`.

    Raises:
        RequestError: INVALID_ARGUMENT with SamplingParams' own message (allowed range).
    """
    return build_sampling(
        max_tokens=msg.max_tokens, temperature=msg.temperature, top_k=msg.top_k,
        top_p=msg.top_p if msg.top_p != 0 else 1.0,
        seed=msg.seed if msg.HasField("seed") else None, ignore_eos=msg.ignore_eos,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0, min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        grammar=_grammar_from_proto(msg.grammar) if msg.HasField("grammar") else None)


def _grammar_from_proto(msg: pb.Grammar) -> GrammarSpec:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise RequestError("INVALID_ARGUMENT", "sampling.grammar is set but empty: set one of "
                                               "json_schema, regex, lark")
    try:
        return GrammarSpec(kind, getattr(msg, kind))
    except ValueError as exc:
        raise RequestError("INVALID_ARGUMENT", f"sampling.grammar: {exc}") from None


def build_sampling(max_tokens: int, temperature: float, top_k: int, top_p: float,
                   seed: int | None, ignore_eos: bool, **processing: Any) -> SamplingParams:
    """:class:`SamplingParams` from a client's values (gRPC's and the OpenAI HTTP API's), so
    both edges refuse a bad value with the same message. ``processing``: the other
    SamplingParams fields (penalties, min_tokens, stop_token_ids, logprobs, grammar).

    Raises:
        RequestError: INVALID_ARGUMENT: ``max_tokens`` 0 (unset), or SamplingParams' own
            message (allowed range).
    """
    if max_tokens == 0:
        raise RequestError("INVALID_ARGUMENT", "sampling.max_tokens is required: set how many "
                                               "tokens to generate (>= 1)")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=seed, ignore_eos=ignore_eos, **processing)
    except ValueError as exc:
        raise RequestError("INVALID_ARGUMENT", f"sampling: {exc}") from None


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """:class:`SamplingParams` -> proto (client side)."""
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k,
        top_p=params.top_p, ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids))
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.grammar is not None:
        msg.grammar.CopyFrom(pb.Grammar(**{params.grammar.kind: params.grammar.source}))
    return msg


def generate_input_from_proto(msg: pb.GenerateRequest) -> GenerateInput:
    """Proto request -> :class:`GenerateInput` (no tokenization or model checks yet).

    Raises:
        RequestError: INVALID_ARGUMENT when no prompt is set, the request_id breaks
            ``limits.REQUEST_ID_RULE`` or sampling is out of range.
    """
    check_request_id(msg.request_id, allow_empty=True)
    which = msg.WhichOneof("prompt")
    if which is None:
        raise RequestError("INVALID_ARGUMENT",
                           "the request has no prompt: set `text` or `token_ids`")
    text = msg.text if which == "text" else None
    ids = tuple(msg.token_ids.ids) if which == "token_ids" else None
    return GenerateInput(text=text, token_ids=ids, sampling=sampling_from_proto(msg.sampling),
                         request_id=msg.request_id, stop=tuple(msg.sampling.stop))


def choices_from_proto(msg: pb.GenerateRequest) -> list[GenerateInput]:
    """Proto request -> its ``n`` router requests (``orchestrator.router.fan_out``).

    Raises:
        RequestError: INVALID_ARGUMENT as :func:`generate_input_from_proto`, or ``n`` over
            ``fan_out.MAX_CHOICES``.
    """
    return choice_inputs(generate_input_from_proto(msg), msg.n or 1)


def abort_id_from_proto(msg: pb.AbortRequest) -> str:
    """The id an Abort names.

    Raises:
        RequestError: INVALID_ARGUMENT when it is empty or breaks ``limits.REQUEST_ID_RULE``.
    """
    check_request_id(msg.request_id, allow_empty=False)
    return msg.request_id


def generate_input_to_proto(inp: GenerateInput, n: int = 1) -> pb.GenerateRequest:
    """:class:`GenerateInput` (+ ``n`` choices) -> proto (client side)."""
    msg = pb.GenerateRequest(sampling=sampling_to_proto(inp.sampling),
                             request_id=inp.request_id, n=n)
    msg.sampling.stop.extend(inp.stop)
    if inp.token_ids is not None:
        msg.token_ids.ids.extend(inp.token_ids)
    else:
        msg.text = inp.text or ""
    return msg


def chunk_to_proto(chunk: OutputChunk) -> pb.GenerateResponse:
    """:class:`OutputChunk` -> proto response message."""
    msg = pb.GenerateResponse(request_id=chunk.request_id, token_ids=list(chunk.token_ids),
                              text=chunk.text, finish_reason=chunk.finish_reason or "",
                              index=chunk.index)
    msg.logprobs.extend(pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                        top=[pb.TopLogprob(token_id=t, logprob=v)
                                             for t, v in lp.top])
                        for lp in chunk.logprobs)
    if chunk.stats is not None:
        s = chunk.stats
        msg.stats.CopyFrom(pb.GenerateStats(
            prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens,
            ttft_s=s.ttft_s, tpot_s=s.tpot_s, e2e_s=s.e2e_s,
            prefill_instance=s.prefill_instance, decode_instance=s.decode_instance,
            cached_tokens=s.cached_tokens, ttft_phases=s.ttft_phases))
    return msg


def chunk_from_proto(msg: pb.GenerateResponse) -> OutputChunk:
    """Proto response message -> :class:`OutputChunk` (client side)."""
    stats = None
    if msg.HasField("stats"):
        s = msg.stats
        stats = RequestStats(prompt_tokens=s.prompt_tokens,
                             completion_tokens=s.completion_tokens, ttft_s=s.ttft_s,
                             tpot_s=s.tpot_s, e2e_s=s.e2e_s,
                             prefill_instance=s.prefill_instance,
                             decode_instance=s.decode_instance,
                             cached_tokens=s.cached_tokens,
                             ttft_phases=dict(s.ttft_phases))
    logprobs = tuple(TokenLogprobs(lp.token_id, lp.logprob,
                                   tuple((t.token_id, t.logprob) for t in lp.top))
                     for lp in msg.logprobs)
    return OutputChunk(request_id=msg.request_id, token_ids=tuple(msg.token_ids),
                       text=msg.text, finish_reason=msg.finish_reason or None, stats=stats,
                       logprobs=logprobs, index=msg.index)


def status_to_proto(views: list[InstanceView], in_flight: int,
                    model: str) -> pb.GetStatusResponse:
    """Instance rows -> GetStatusResponse."""
    out = pb.GetStatusResponse(in_flight=in_flight, model=model)
    for v in views:
        msg = pb.InstanceStatus(name=v.name, role=v.role, tp=v.tp, health=v.health,
                                detail=v.detail, has_load=v.status is not None,
                                router_outstanding_tokens=v.router_tokens)
        s = v.status
        if s is not None:
            msg.ranks.extend(pb.RankStatus(rank=r, node_id=n, device=d, pid=pid)
                             for r, n, d, pid in s.ranks)
            msg.MergeFrom(pb.InstanceStatus(
                queue_depth=s.queue_depth, running=s.running, free_blocks=s.free_blocks,
                total_blocks=s.total_blocks, outstanding_tokens=s.outstanding_tokens,
                kv_bytes_sent=s.kv_bytes_sent, kv_failures=s.kv_failures,
                cached_blocks=s.cached_blocks, prefix_hit_tokens=s.prefix_hit_tokens,
                prefix_queried_tokens=s.prefix_queried_tokens,
                kv_tail=pb.KVTail(count=s.kv_tail.count, sum_s=s.kv_tail.sum_s,
                                  max_s=s.kv_tail.max_s, last_s=s.kv_tail.last_s),
                spec_acceptance_rate=s.spec_acceptance_rate,
                spec_mean_accepted_length=s.spec_mean_accepted_length))
            msg.step_phases.extend(pb.StepPhase(phase=name, count=rec.count,
                                                total_s=rec.total_s)
                                   for name, rec in (("step", s.step_timings.step),
                                                     *s.step_timings.phases.items()))
            msg.kv_groups.extend(pb.KVGroupBlocks(group=g, free_blocks=free,
                                                  total_blocks=total)
                                 for g, free, total in s.kv_groups)
            msg.graph_modes.extend(pb.GraphMode(forward=f, state=state)
                                   for f, state in s.graph_modes)
        out.instances.append(msg)
    return out


def status_from_proto(msg: pb.GetStatusResponse) -> list[InstanceView]:
    """GetStatusResponse -> instance rows (client side)."""
    return [InstanceView(name=i.name, role=i.role, tp=i.tp, health=i.health, detail=i.detail,
                         status=_load_from_proto(i) if i.has_load else None,
                         router_tokens=i.router_outstanding_tokens)
            for i in msg.instances]


def _load_from_proto(i: pb.InstanceStatus) -> InstanceStatusInfo:
    return InstanceStatusInfo(
        name=i.name, role=i.role, tp=i.tp,
        ranks=tuple((r.rank, r.node_id, r.device, r.pid) for r in i.ranks),
        queue_depth=i.queue_depth, running=i.running, free_blocks=i.free_blocks,
        total_blocks=i.total_blocks, outstanding_tokens=i.outstanding_tokens,
        kv_bytes_sent=i.kv_bytes_sent, kv_failures=i.kv_failures,
        cached_blocks=i.cached_blocks, prefix_hit_tokens=i.prefix_hit_tokens,
        prefix_queried_tokens=i.prefix_queried_tokens,
        step_timings=_timings_from_proto(i.step_phases),
        kv_tail=KVTailStats(i.kv_tail.count, i.kv_tail.sum_s, i.kv_tail.max_s,
                            i.kv_tail.last_s),
        spec_acceptance_rate=i.spec_acceptance_rate,
        spec_mean_accepted_length=i.spec_mean_accepted_length,
        kv_groups=tuple((g.group, g.free_blocks, g.total_blocks) for g in i.kv_groups),
        graph_modes=tuple((g.forward, g.state) for g in i.graph_modes))


def _timings_from_proto(phases) -> StepTimings:
    """``StepPhase`` rows -> :class:`StepTimings` (the recent window does not travel)."""
    recs = {p.phase: PhaseTiming(p.count, p.total_s) for p in phases}
    step = recs.pop("step", PhaseTiming())
    return StepTimings(step, recs)
