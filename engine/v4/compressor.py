"""Token-group compression (DeepSeek-V4 paper §2.3) and the lightning indexer (§2.3.1).

Compressor, per layer (and a second, narrower one inside the indexer): every ``ratio`` source
tokens make one entry ``C_i = RMSNorm(sum_j softmax_j(Z_j + B) * C_j)`` with ``C = x W_kv``,
``Z = x W_gate``, ``B = position_bias [ratio, coff * d]``; rope (the ``compress`` rope) at the
group's first token position ``i * ratio``. HCA (ratio 128): groups do not overlap (coff 1).
CSA (ratio 4, coff 2): each token projects two series, Ca = ``[:d]`` and Cb = ``[d:]``; entry
w pools group w-1's Ca with group w's Cb (2 * ratio slots; before group 0 the Ca slots are
empty: zero kv, -inf gate). State between calls (:class:`engine.v4.cache.CompressorState`): the
projections of the tokens of the open group, and CSA's last full group's Ca.

Indexer: ``I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . K[s]) / sqrt(c_I)``, ``w = x W_w /
sqrt(n_h)``; each query keeps the top ``index_topk`` entries among those whose whole group is
at or before it (entry s is visible to a query at position p when ``s < (p + 1) // ratio``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.norm import RMSNorm
from engine.v4.cache import CompressorState
from engine.v4.rope import V4Rotary, rotate_trailing


class Compressor(nn.Module):
    """Compress ``ratio`` tokens into one ``head_dim`` entry (``overlap``: CSA's two series).

    Parameters (transformers names): ``kv_proj``, ``gate_proj`` ``[coff * d, hidden]``,
    ``position_bias [ratio, coff * d]``, ``kv_norm [d]``.
    """

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, overlap: bool,
                 eps: float) -> None:
        super().__init__()
        coff = 2 if overlap else 1
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        self.kv_proj = nn.Linear(hidden_size, coff * head_dim, bias=False)
        self.gate_proj = nn.Linear(hidden_size, coff * head_dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, coff * head_dim))
        self.kv_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, state: CompressorState, rotary: V4Rotary) -> torch.Tensor:
        """Feed ``x [T, hidden]`` (the next T tokens); append the entries of the groups they
        close to ``state.entries`` and return all entries ``[E, d]``."""
        kv, gate = self.kv_proj(x), self.gate_proj(x)  # [T, coff*d]
        if state.buffer_kv is not None:
            kv, gate = torch.cat((state.buffer_kv, kv)), torch.cat((state.buffer_gate, gate))
        usable = kv.shape[0] // self.ratio * self.ratio
        # NOTE: clones, so the state does not keep the whole chunk's projections alive
        state.buffer_kv, state.buffer_gate = kv[usable:].clone(), gate[usable:].clone()
        if usable == 0:
            return state.entries
        n, r, d = usable // self.ratio, self.ratio, self.head_dim
        kv = kv[:usable].view(n, r, -1)
        gate = gate[:usable].view(n, r, -1) + self.position_bias  # [n, r, coff*d]
        if self.overlap:
            kv, gate = self._pair_groups(kv, gate, state)  # [n, 2r, d]
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        pooled = self.kv_norm(pooled)  # [n, d]
        first = state.num_entries * r
        positions = torch.arange(n, device=x.device) * r + first
        cos, sin = rotary.cos_sin(positions, pooled.dtype)
        return state.append_entries(rotate_trailing(pooled, cos, sin))

    def _pair_groups(self, kv: torch.Tensor, gate: torch.Tensor, state: CompressorState
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, r, 2d]`` groups -> ``[n, 2r, d]``: slots [Ca of group w-1 | Cb of group w];
        ``state.overlap_*`` carries the last group's Ca to the next call."""
        r, d = self.ratio, self.head_dim
        prev_kv = kv.new_zeros(1, r, d) if state.overlap_kv is None else state.overlap_kv[None]
        prev_gate = (gate.new_full((1, r, d), float("-inf")) if state.overlap_gate is None
                     else state.overlap_gate[None])
        ca_kv = torch.cat((prev_kv, kv[:-1, :, :d]))  # [n, r, d]
        ca_gate = torch.cat((prev_gate, gate[:-1, :, :d]))
        state.overlap_kv, state.overlap_gate = kv[-1, :, :d].clone(), gate[-1, :, :d].clone()
        return (torch.cat((ca_kv, kv[:, :, d:]), dim=1),
                torch.cat((ca_gate, gate[:, :, d:]), dim=1))


class Indexer(Compressor):
    """Lightning indexer of a CSA layer: its own CSA-style compressor at ``index_head_dim``
    (the inherited parameters) plus ``q_b_proj [n_h * c_I, q_lora_rank]`` and
    ``scorer.weights_proj [n_h, hidden]`` (transformers names)."""

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int,
                 ratio: int, topk: int, eps: float) -> None:
        super().__init__(hidden_size, head_dim, ratio, overlap=True, eps=eps)
        self.n_heads, self.topk = n_heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
               state: CompressorState, rotary: V4Rotary) -> torch.Tensor:
        """Top-k entry ids ``[T, k]`` (``-1``: no pick) for queries at ``positions [T]``.

        ``x [T, hidden]``, ``q_residual [T, q_lora_rank]`` (the attention's normed q_a);
        feeds ``x`` to the indexer's compressor state first.
        """
        keys = self(x, state, rotary)  # [E, c_I]
        num = keys.shape[0]
        if num == 0:
            return torch.zeros(x.shape[0], 0, dtype=torch.long, device=x.device)
        cos, sin = rotary.cos_sin(positions, x.dtype)
        q = self.q_b_proj(q_residual).view(-1, self.n_heads, self.head_dim)
        q = rotate_trailing(q, cos, sin)  # [T, n_h, c_I]
        scores = torch.relu(torch.matmul(q.float(), keys.float().T)) * self.head_dim ** -0.5
        weights = self.scorer.weights_proj(x).float() * self.n_heads ** -0.5  # [T, n_h]
        index = (scores * weights[..., None]).sum(dim=1)  # [T, E]
        visible = (positions[:, None] + 1) // self.ratio  # [T, 1]
        future = torch.arange(num, device=x.device)[None] >= visible
        top = index.masked_fill(future, float("-inf")).topk(min(self.topk, num), dim=-1).indices
        return torch.where(top >= visible, torch.full_like(top, -1), top)


class SparseCompressor(Compressor):
    """CSA's compressor (overlapping groups) owning the layer's :class:`Indexer`."""

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, eps: float,
                 indexer: Indexer) -> None:
        super().__init__(hidden_size, head_dim, ratio, overlap=True, eps=eps)
        self.indexer = indexer
