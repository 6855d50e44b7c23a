"""One speculative step on one rank: MTP drafts -> main forward -> MTP over prompt rows.

The MTP module (:class:`engine.model.MTPLayer`) at position i reads the main model's normed
hidden state ``h_i`` and the embedding of ``t_{i+1}`` (DeepSeek-V3 report sec. 2.2)::

    g_i = Block(eh_proj([enorm(Emb(t_{i+1})) ; hnorm(h_i)]));  draft_{i+2} = argmax lm_head(
          shared_head.norm(g_i))

so its row i can run once ``t_{i+1}`` is known. Every step (same calls on every TP rank, so
no rank-to-rank traffic beyond the model's own):

1. Draft (k forwards of the MTP module): for each sequence with a :class:`DraftInput` (the
   rows of its last step whose next token is now known, ``h`` kept by the leader), the MTP
   module runs over those rows, writing its KV (also for a step that makes no draft, e.g.
   out of token budget, so the next draft reads a complete MTP cache), and its last row
   gives draft 1; drafts 2..k chain on the module's own output ``g`` at the next positions (vLLM / SGLang reuse).
   Drafts are the argmax (deterministic: every rank drafts the same tokens).
2. Main forward over ``[t_n, d_1 .. d_j]`` of each speculating sequence and the usual tokens
   of the others; logits at every row of a speculating sequence, at the last row otherwise.
3. MTP over prompt rows (1 forward): for a prefill chunk, every row whose next token is known
   (all of them when the prompt goes on, all but the last otherwise), so the MTP KV cache of
   the prompt is complete before the first draft and travels with the rest (PD); the last
   prompt row is the first draft's (1., from ``h`` at that row: on PD the decode side gets
   it from the completion records, ``kv_transfer.wire.Header.draft_hidden``).

Under expert parallelism each of the k + 2 forwards runs on every rank every step, empty
(only the MoE exchange) where a rank has no rows (DP lockstep). With graph mode the forwards
of 1. and 2. are one-token rows and run captured (buckets in tokens, ``b * (1 + k)`` for each
batch size b): 2. through the runner's main-forward graphs (returning hidden states), 1.
through :attr:`SpecForward.draft_graphs`, padded with rows writing the scratch block; 3.
(prompt rows) and steps with prompt chunks run eager.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from itertools import accumulate

import torch

from engine.forward_context import AttentionMetadata, build_attention_metadata
from engine.graph import DecodeGraphs, GraphConfig, mark_context_dynamic
from engine.kv_cache import KVCache
from engine.model import DeepseekForCausalLM
from engine.sampling import greedy_argmax
from engine.spec_decode import DraftInput, SpecOutput

# The runner's input builder: steps -> (input_ids [T], metadata) of the main forward.
InputsFn = Callable[[list], tuple[torch.Tensor, AttentionMetadata]]
# The runner's captured main forward: one-token steps -> [T, hidden] normed hidden states,
# or None (runs eager).
CapturedFn = Callable[[list], torch.Tensor | None]


class SpecForward:
    """The speculative step of one rank (module docstring).

    Args:
        model: the model, built with its MTP module. kv_cache: the rank's cache, whose last
            layer (``num_hidden_layers``) is the MTP module's.
        num_speculative_tokens: k, the most drafts per sequence per step.
        inputs: the runner's main-forward input builder. ep_size: EP ranks (1: off).
        captured: the runner's captured main forward (``ModelRunner._captured``; None: the
            main forward always runs eager). padding: ``context -> SeqStep`` of a graph
            padding row (``ModelRunner._padding_step``). graph: the graph config in tokens
            (``GraphConfig.in_tokens(1 + k)``); enabled: the draft forward is captured too.

    Attributes:
        draft_graphs: the captured MTP forwards (:class:`engine.graph.DecodeGraphs`,
            "draft"), None with graph mode off.
    """

    def __init__(self, model: DeepseekForCausalLM, kv_cache: KVCache,
                 num_speculative_tokens: int, inputs: InputsFn, ep_size: int = 1,
                 captured: CapturedFn | None = None, padding: Callable | None = None,
                 graph: GraphConfig | None = None) -> None:
        self.model, self.kv_cache, self.k = model, kv_cache, num_speculative_tokens
        self.inputs, self.ep_size = inputs, ep_size
        self.captured, self.padding = captured, padding
        self.mtp = model.mtp
        self.mtp_layer = model.config.num_hidden_layers
        self.draft_graphs = DecodeGraphs(model.forward_mtp, graph, kv_cache.device.type,
                                         "draft") if graph is not None and graph.enabled \
            else None

    def run(self, steps: list, on_kv_written: Callable[[int], None] | None = None
            ) -> SpecOutput:
        """Draft, verify-forward and MTP over ``steps`` (``engine.runner.SeqStep``; a step's
        ``draft`` / ``num_drafts`` / ``next_token_id`` say what to draft and what is known).
        ``on_kv_written(layer)``: called after each main layer's KV write and after the MTP
        layer's (layer-by-layer KV sends, prefill_worker/kv_sends.py)."""
        drafts = self._draft(steps)
        main = [replace(s, token_ids=s.token_ids + d) for s, d in zip(steps, drafts)]
        hidden, meta = self._main_forward([row for s in main for row in _as_rows(s)],
                                          on_kv_written)  # [T, H]
        if meta is not None and meta.cp is not None:  # NOTE: CP prefill: T local, no drafts
            return self._cp_prompt_rows(main, hidden, meta, on_kv_written)
        ends = list(accumulate(len(s.token_ids) for s in main))
        rows = [range(end - 1 - len(d), end) for end, d in zip(ends, drafts)]
        index = torch.tensor([r for rs in rows for r in rs], device=hidden.device)
        logits = self.model.compute_logits(hidden[index])  # [R, vocab]
        self._prompt_rows(main, hidden, ends)
        if on_kv_written is not None:
            on_kv_written(self.mtp_layer)
        kept = tuple(hidden[rs.start:rs.stop].clone() for rs in rows)
        return SpecOutput(logits, tuple(drafts), kept)

    def run_empty(self) -> None:
        """A zero-token step's collectives in :meth:`run`'s order: k MTP forwards, the main
        model's, one MTP forward (NOTE: the order matters: each exchange meets the other
        ranks' exchange of the same layer). No-op without EP."""
        if self.ep_size == 1:
            return
        for _ in range(self.k):
            self._empty()
        self.model.forward_empty()
        self._empty()

    def _draft(self, steps: list) -> list[tuple[int, ...]]:
        """Per step its drafts (k forwards of the MTP module; module docstring, 1.)."""
        drafts: list[list[int]] = [[] for _ in steps]
        last: dict[int, torch.Tensor] = {}  # step -> its latest MTP output g [H]
        # NOTE: a step with a draft input but no drafts (budget) still writes its MTP rows
        todo = [i for i, s in enumerate(steps) if s.draft is not None]
        for j in range(self.k):
            live = [i for i in todo if steps[i].num_drafts > j or j == 0]
            if not live:
                self._empty()
                continue
            if j == 0:  # NOTE: one 1-token row per position (batched paged decode attention)
                ins: list[DraftInput] = [steps[i].draft for i in live]
                g = self._mtp([t for d in ins for t in d.token_ids],
                              torch.cat([d.hidden for d in ins]),
                              [1] * sum(len(d.token_ids) for d in ins),
                              [d.start + r for d in ins for r in range(len(d.token_ids))],
                              [steps[i].block_ids for i, d in zip(live, ins)
                               for _ in d.token_ids])
                g = g[[end - 1 for end in accumulate(len(d.token_ids) for d in ins)]]
            else:
                g = self._mtp([drafts[i][-1] for i in live],
                              torch.stack([last[i] for i in live]), [1] * len(live),
                              [steps[i].num_computed_tokens + j - 1 for i in live],
                              [steps[i].block_ids for i in live])
            ids = greedy_argmax(self.model.compute_logits(self.mtp.shared_head.norm(g))).tolist()
            for i, g_row, token in zip(live, g, ids):
                last[i] = g_row
                if steps[i].num_drafts > j:
                    drafts[i].append(int(token))
        return [tuple(d) for d in drafts]

    def _prompt_rows(self, steps: list, hidden: torch.Tensor, ends: list[int]) -> None:
        """MTP over every row of a non-drafting step whose next token is known (module
        docstring, 3.); ``hidden [T, H]`` of the main forward, ``ends`` each step's end row."""
        tokens: list[int] = []
        parts, q_lens, ctx, tables = [], [], [], []
        for s, end in zip(steps, ends):
            if s.draft is not None:
                continue
            nxt = () if s.next_token_id is None else (s.next_token_id,)
            ids = s.token_ids[1:] + nxt  # t_{i+1} of each row i that has it
            if not ids:
                continue
            start = end - len(s.token_ids)
            tokens.extend(ids)
            parts.append(hidden[start:start + len(ids)])
            q_lens.append(len(ids))
            ctx.append(s.num_computed_tokens)
            tables.append(s.block_ids)
        if not tokens:
            self._empty()
            return
        self._mtp(tokens, torch.cat(parts), q_lens, ctx, tables)

    def _main_forward(self, rows: list, on_kv_written: Callable[[int], None] | None
                      ) -> tuple[torch.Tensor, AttentionMetadata | None]:
        """The main forward over ``rows`` (``SeqStep``): ``[T, H]`` normed hidden states (T:
        this rank's rows under CP) and the metadata it ran with; from the runner's captured
        forward (metadata None) when every row is one decode token and a bucket fits (and no
        per-layer callback is asked for), else eager."""
        if on_kv_written is None and self.captured is not None:
            hidden = self.captured(rows)
            if hidden is not None:
                return hidden, None
        input_ids, meta = self.inputs(rows)
        meta = replace(meta, on_kv_written=on_kv_written)
        return self.model(input_ids, meta, self.kv_cache, return_hidden=True), meta

    def _cp_prompt_rows(self, steps: list, hidden: torch.Tensor, meta: AttentionMetadata,
                        on_kv_written: Callable[[int], None] | None) -> SpecOutput:
        """Context-parallel prefill: the MTP module over this rank's rows of the prompt
        chunks (``hidden [T_local, H]``) with the main forward's CP split, as one more layer
        (its KV gathered to every rank); logits and kept ``h`` at each chunk's last row.
        NOTE: a last prompt row has no next token yet: it runs with a placeholder (token 0)
        and its MTP slot is put back as it was (a hole, as without CP: decode's first draft
        step writes it); rows before it never attend to it (causal)."""
        ends = list(accumulate(len(s.token_ids) for s in steps))
        holes = meta.slot_mapping[[end - 1 for s, end in zip(steps, ends)
                                   if s.next_token_id is None]]
        saved = self.kv_cache.read(self.mtp_layer, holes)
        nxt = torch.tensor([t for s in steps for t in (*s.token_ids[1:], s.next_token_id or 0)],
                           dtype=torch.int64, device=hidden.device)
        self.model.forward_mtp(nxt[meta.cp.local_rows], hidden,
                               replace(meta, on_kv_written=None), self.kv_cache)
        for buf, rows in zip(self.kv_cache.flat_buffers(self.mtp_layer), saved):
            buf[holes] = rows
        if on_kv_written is not None:
            on_kv_written(self.mtp_layer)
        last = meta.cp.gather_last(hidden)  # [B, H]
        return SpecOutput(self.model.compute_logits(last), ((),) * len(steps),
                          tuple(last[b:b + 1].clone() for b in range(len(steps))))

    def warmup_graphs(self, padding) -> DecodeGraphs | None:
        """Capture every draft bucket now over ``padding`` rows only (a ``SeqStep`` writing
        the scratch block); returns :attr:`draft_graphs`."""
        empty = self.model.lm_head.weight.new_empty(0, self.model.config.hidden_size)
        for bucket in self.draft_graphs.config.batch_sizes if self.draft_graphs else ():
            self._mtp_captured([], empty, [], [], bucket, padding)
        return self.draft_graphs

    def _mtp(self, token_ids: list[int], hidden: torch.Tensor, q_lens: list[int],
             ctx_lens: list[int], tables: list[tuple[int, ...]]) -> torch.Tensor:
        """One MTP forward: ``token_ids`` (t_{i+1} per row), ``hidden [T, H]`` (h_i), rows
        grouped per sequence (``q_lens`` rows after ``ctx_lens`` cached) -> ``g [B, H]`` at
        each sequence's last row; writes the MTP KV cache of every row. One-token rows run
        the captured draft forward of the smallest bucket that fits, when there is one."""
        bucket = self.draft_graphs.bucket_for(q_lens, ctx_lens) if self.draft_graphs else None
        if bucket is not None:
            g = self._mtp_captured(token_ids, hidden, ctx_lens, tables, bucket)
            if g is not None:
                return g
        meta = build_attention_metadata(q_lens, ctx_lens, list(tables),
                                        self.kv_cache.spec.block_size, hidden.device)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=hidden.device)
        return self.model.forward_mtp(ids, hidden, meta, self.kv_cache)[meta.logits_index]

    def _mtp_captured(self, token_ids: list[int], hidden: torch.Tensor, ctx_lens: list[int],
                      tables: list[tuple[int, ...]], bucket: int, padding=None
                      ) -> torch.Tensor | None:
        """``g [T, H]`` of T one-token rows from the captured draft forward of ``bucket``
        (padded to ``bucket`` rows by ``padding``, default ``self.padding()``: token 0,
        ``h = 0``, KV to the scratch block), or None when that bucket runs eager."""
        pad = padding or self.padding()
        extra = bucket - len(token_ids)
        ids = torch.tensor(list(token_ids) + [pad.token_ids[0]] * extra, dtype=torch.int64,
                           device=hidden.device)
        dtype = self.model.lm_head.weight.dtype  # NOTE: one dtype: no recompile on fp32 h
        h = torch.cat([hidden.to(dtype), hidden.new_zeros(extra, hidden.shape[1], dtype=dtype)])
        meta = build_attention_metadata([1] * bucket,
                                        list(ctx_lens) + [pad.num_computed_tokens] * extra,
                                        list(tables) + [pad.block_ids] * extra,
                                        self.kv_cache.spec.block_size, hidden.device)
        mark_context_dynamic(meta.decode)
        g = self.draft_graphs.run(bucket, ids, h, meta, self.kv_cache)
        return None if g is None else g[:len(token_ids)]

    def _empty(self) -> None:
        if self.ep_size > 1:
            self.model.mtp_forward_empty()


def _as_rows(step):
    """A drafting step as one 1-token step per position (each a decode row of the batched
    paged attention, attending up to its own position; the step's KV is written before
    attention reads it), any other step as it is."""
    if step.draft is None or len(step.token_ids) == 1:
        return [step]
    return [replace(step, token_ids=(t,), num_computed_tokens=step.num_computed_tokens + j,
                    draft=None, num_drafts=0) for j, t in enumerate(step.token_ids)]
