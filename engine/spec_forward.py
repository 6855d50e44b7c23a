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
(only the MoE exchange) where a rank has no rows (DP lockstep). Drafted steps run eager
(graph buckets capture 1-token decode steps only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from itertools import accumulate

import torch

from engine.forward_context import AttentionMetadata, build_attention_metadata
from engine.kv_cache import KVCache
from engine.model import DeepseekForCausalLM
from engine.sampling import greedy_argmax
from engine.spec_decode import DraftInput, SpecOutput

# The runner's input builder: steps -> (input_ids [T], metadata) of the main forward.
InputsFn = Callable[[list], tuple[torch.Tensor, AttentionMetadata]]


class SpecForward:
    """The speculative step of one rank (module docstring).

    Args:
        model: the model, built with its MTP module. kv_cache: the rank's cache, whose last
            layer (``num_hidden_layers``) is the MTP module's.
        num_speculative_tokens: k, the most drafts per sequence per step.
        inputs: the runner's main-forward input builder. ep_size: EP ranks (1: off).
    """

    def __init__(self, model: DeepseekForCausalLM, kv_cache: KVCache,
                 num_speculative_tokens: int, inputs: InputsFn, ep_size: int = 1) -> None:
        self.model, self.kv_cache, self.k = model, kv_cache, num_speculative_tokens
        self.inputs, self.ep_size = inputs, ep_size
        self.mtp = model.mtp
        self.mtp_layer = model.config.num_hidden_layers

    def run(self, steps: list, on_kv_written: Callable[[int], None] | None = None
            ) -> SpecOutput:
        """Draft, verify-forward and MTP over ``steps`` (``engine.runner.SeqStep``; a step's
        ``draft`` / ``num_drafts`` / ``next_token_id`` say what to draft and what is known).
        ``on_kv_written(layer)``: called after each main layer's KV write and after the MTP
        layer's (layer-by-layer KV sends, prefill_worker/kv_sends.py)."""
        drafts = self._draft(steps)
        main = [replace(s, token_ids=s.token_ids + d) for s, d in zip(steps, drafts)]
        input_ids, meta = self.inputs([row for s in main for row in _as_rows(s)])
        if on_kv_written is not None:
            meta = replace(meta, on_kv_written=on_kv_written)
        hidden = self.model(input_ids, meta, self.kv_cache, return_hidden=True)  # [T, H]
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

    def _mtp(self, token_ids: list[int], hidden: torch.Tensor, q_lens: list[int],
             ctx_lens: list[int], tables: list[tuple[int, ...]]) -> torch.Tensor:
        """One MTP forward: ``token_ids`` (t_{i+1} per row), ``hidden [T, H]`` (h_i), rows
        grouped per sequence (``q_lens`` rows after ``ctx_lens`` cached) -> ``g [B, H]`` at
        each sequence's last row; writes the MTP KV cache of every row."""
        device = hidden.device
        meta = build_attention_metadata(q_lens, ctx_lens, list(tables),
                                        self.kv_cache.spec.block_size, device)
        embeds = self.model.model.embed_tokens(
            torch.tensor(token_ids, dtype=torch.int64, device=device))
        cos, sin = self.model.rotary.cos_sin(meta.positions, embeds.dtype)
        g = self.mtp.forward_mtp(embeds, hidden.to(embeds.dtype), cos, sin, meta,
                                 self.kv_cache.layer_buffers(self.mtp_layer))
        return g[meta.logits_index]

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
