"""DeepSeek-V2/V3/V3.2 and GLM-5 decoder for serving: embed -> layers (MLA + dense/MoE MLP)
-> norm -> lm_head.

Parameter names equal the HF checkpoint's, so the loader maps names one to one. The parallel
layout is applied from outside (:mod:`engine.layout`): modules are built with
:class:`TPLayout`'s local sizes; each decoder layer all-reduces twice over TP, embed_tokens
and lm_head are vocab-parallel, MoE layers hold only this rank's experts under EP, and under
context parallel each rank runs its share of the step's tokens with layer-sharded weights
arriving through :attr:`DeepseekForCausalLM.prefetcher`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import MLAttention
from engine.forward_context import AttentionMetadata
from engine.kernels import KernelSet
from engine.kv_cache import KVCache
from engine.layer_sharding import LayerPrefetcher, check_sharded_modules
from engine.layout import TPLayout, tp_layout
from engine.model_config import ModelConfig
from engine.moe import MLP, MoE, MoEGate, fuse_weights
from engine.norm import RMSNorm
from engine.parallel import EPGroup, TPGroup
from engine.quant.linear import QuantPlan, quantize_modules
from engine.rotary import RotaryEmbedding
from engine.sparse_attention import SharedSelection


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, config: ModelConfig, layer_idx: int, layout: TPLayout, tp: TPGroup,
                 ep: EPGroup, kernels: KernelSet) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layout.num_attention_heads, kernels, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config, layout, tp, ep) if config.is_moe_layer(layer_idx) \
            else MLP(config.hidden_size, layout.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, caches: tuple[torch.Tensor, ...],
                shared: SharedSelection | None = None) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; writes this layer's KV of the T tokens
        (``caches``: ``KVCache.layer_buffers(i)``); ``shared``: the step's DSA selections."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, meta, caches, shared)
        h = x + self.tp.all_reduce(attn)
        return h + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(h)))


class SharedHead(nn.Module):
    """MTP's ``shared_head.norm`` (the checkpoint's ``shared_head.head`` is the main lm_head)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3's multi-token-prediction module (report sec. 2.2; maths in
    :mod:`engine.spec_forward`): ``enorm``, ``hnorm``, ``eh_proj``, a decoder block under the
    decoder layer's own names, ``shared_head.norm``. Built as ``model.layers[N]``
    (``N = num_hidden_layers``) so each weight keeps its checkpoint name."""

    def __init__(self, config: ModelConfig, layout: TPLayout, tp: TPGroup, ep: EPGroup,
                 kernels: KernelSet) -> None:
        super().__init__(config, config.num_hidden_layers, layout, tp, ep, kernels)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(h, eps)

    def forward_mtp(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, meta: AttentionMetadata,
                    caches: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``embeds [T, hidden]`` (embedding of t_{i+1}), ``hidden [T, hidden]`` (h_i, the main
        model's normed last hidden state or, chained, a previous ``g``) -> ``g [T, hidden]``
        before ``shared_head.norm``; writes the module's KV of the T positions."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self(x, cos, sin, meta, caches, SharedSelection())


class VocabParallelEmbedding(nn.Module):
    """Embedding of rows ``tp.rank * n .. + n - 1`` of the vocabulary (``n`` = ``local_vocab``);
    ids elsewhere embed to zero here and the TP all-reduce fills them in."""

    def __init__(self, local_vocab: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(local_vocab, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 -> ``[T, hidden]`` (complete on every TP rank)."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.tp.rank * self.weight.shape[0]
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0.0))


class DeepseekModel(nn.Module):
    """The ``model.*`` part of the checkpoint."""

    def __init__(self, config: ModelConfig, layout: TPLayout, tp: TPGroup, ep: EPGroup,
                 kernels: KernelSet, mtp: bool = False) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(layout.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, layout, tp, ep, kernels)
                                    for i in range(config.num_hidden_layers))
        if mtp:  # NOTE: layers[num_hidden_layers]; the decoder loop stops before it
            self.layers.append(MTPLayer(config, layout, tp, ep, kernels))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """Full model; :meth:`forward` runs one step and returns last-token logits."""

    def __init__(self, config: ModelConfig, layout: TPLayout, tp: TPGroup, ep: EPGroup,
                 kernels: KernelSet, mtp: bool = False) -> None:
        super().__init__()
        self.config, self.layout, self.tp = config, layout, tp
        self.model = DeepseekModel(config, layout, tp, ep, kernels, mtp)
        self.lm_head = nn.Linear(config.hidden_size, layout.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.prefetcher: LayerPrefetcher | None = None  # layer sharding (runner sets it)
        self._kernels = kernels
        self._logits_gemm: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def mtp(self) -> MTPLayer | None:
        """The MTP module (``model.layers[num_hidden_layers]``), None when not built."""
        layers = self.model.layers
        return layers[-1] if len(layers) > self.config.num_hidden_layers else None

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, return_hidden: bool = False) -> torch.Tensor:
        """One step: ``input_ids [T]`` int64 (under CP only ``meta.cp.local_rows``) ->
        ``[B, vocab]`` fp32 logits at each sequence's last token; layer i writes
        ``kv_cache.layer_buffers(i)``. ``return_hidden`` (no CP): ``[T, hidden]`` normed
        last hidden states of every row instead (what lm_head and MTP read)."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        positions = meta.positions if meta.cp is None else meta.positions[meta.cp.local_rows]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # [T, R/2]
        if self.prefetcher is not None:
            self.prefetcher.begin()
        shared = SharedSelection()  # DSA: each full layer's selection, for the shared ones
        for i, layer in enumerate(self.model.layers[:self.config.num_hidden_layers]):
            if self.prefetcher is not None:
                self.prefetcher.before_layer(i)
            x = layer(x, cos, sin, meta, kv_cache.layer_buffers(i), shared)
            if self.prefetcher is not None:
                self.prefetcher.after_layer(i)
        if return_hidden:
            return self.model.norm(x)
        last = x[meta.logits_index] if meta.cp is None else meta.cp.gather_last(x)
        return self.compute_logits(self.model.norm(last))

    def forward_mtp(self, input_ids: torch.Tensor, hidden: torch.Tensor,
                    meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """One MTP forward: ``input_ids [T]`` int64 (t_{i+1} per row), ``hidden [T, hidden]``
        (h_i, or a chained ``g``; under CP T is ``meta.cp.local_rows``) -> ``g [T, hidden]``
        before ``shared_head.norm``; writes the module's cache (``kv_cache``'s last layer)."""
        embeds = self.model.embed_tokens(input_ids)  # [T, hidden]
        positions = meta.positions if meta.cp is None else meta.positions[meta.cp.local_rows]
        cos, sin = self.rotary.cos_sin(positions, embeds.dtype)
        return self.mtp.forward_mtp(embeds, hidden.to(embeds.dtype), cos, sin, meta,
                                    kv_cache.layer_buffers(self.config.num_hidden_layers))

    def prepare_lm_head(self) -> None:
        """Build the vocabulary GEMM of the loaded ``lm_head`` weight (the ``lm_head``
        kernel; on CPU a oneDNN-packed copy, :mod:`engine.lm_head_gemm`). Call once after the
        weights are loaded; until then (and for a quantized lm_head) ``lm_head`` runs itself.
        NOTE: a later change of ``lm_head.weight`` is not seen: call this again."""
        if type(self.lm_head) is nn.Linear:
            self._logits_gemm = self._kernels.lm_head(self.lm_head.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [R, hidden]`` (normed) -> ``[R, vocab]`` fp32 logits (vocab-parallel)."""
        gemm = self._logits_gemm or self.lm_head
        logits = self.tp.all_gather(gemm(hidden).float())  # [R, tp * local vocab]
        return logits[:, :self.config.vocab_size]

    def forward_empty(self) -> None:
        """A zero-token step's collectives: every MoE layer's EP exchange, in layer order
        (attention and the TP all-reduces are skipped: the whole TP group is idle)."""
        x = self.lm_head.weight.new_empty(0, self.config.hidden_size)
        for layer in self.model.layers[:self.config.num_hidden_layers]:
            if isinstance(layer.mlp, MoE):
                layer.mlp(x)

    def mtp_forward_empty(self) -> None:
        """The MTP module's zero-token collectives (its MoE's EP exchange), for lockstep."""
        if self.mtp is not None and isinstance(self.mtp.mlp, MoE):
            self.mtp.mlp(self.lm_head.weight.new_empty(0, self.config.hidden_size))


def build_model(config: ModelConfig, tp: TPGroup, kernels: KernelSet, dtype: torch.dtype,
                device: torch.device, quant: QuantPlan | None = None, *,
                ep: EPGroup | None = None,
                empty: frozenset[str] = frozenset(),
                mtp: bool = False) -> DeepseekForCausalLM:
    """An UNINITIALIZED model (storage allocated, values garbage) for the loader to fill, with
    rank ``tp.rank``'s share of every split weight and, under EP (``ep`` of size > 1), only
    EP rank ``ep.rank``'s routed experts (:func:`engine.layout.tp_layout`).

    NOTE: the router's ``e_score_correction_bias`` stays fp32 whatever ``dtype`` is (as HF);
    ``lm_head.weight`` is ``[hidden, vocab]`` contiguous storage seen as ``[vocab, hidden]``
    (faster decode GEMM on CPU); float MLPs/experts get fused storage
    (:func:`engine.moe.fuse_weights`). ``quant``: a quantized checkpoint's plan.
    ``empty``: parameters left unallocated (:func:`engine.layer_sharding.unowned_params`).
    ``mtp``: also build the checkpoint's MTP module as ``model.layers[num_hidden_layers]``.

    Raises:
        ValueError: ``tp.size`` does not divide a size the layout splits, or ``ep.size`` does
            not divide ``n_routed_experts`` (from ``tp_layout``); an ``empty`` parameter of a
            quantized linear (:func:`engine.layer_sharding.check_sharded_modules`).
    """
    ep = ep or EPGroup()
    layout = tp_layout(config, tp.size, ep.size, ep.rank)
    with torch.device("meta"):
        model = DeepseekForCausalLM(config, layout, tp, ep, kernels, mtp)
    model = model.to(dtype)
    for module in model.modules():
        if isinstance(module, MoEGate) and module.e_score_correction_bias is not None:
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    quantize_modules(model, quant, kernels)
    check_sharded_modules(tuple({name.split(".")[-2] for name in empty}), model.model.layers)
    for name in empty:  # layer-sharded weights another CP rank stores: never allocated
        param = model.get_parameter(name)
        param.data = param.new_empty(0)
    model = model.to_empty(device=device)
    fuse_weights(model)
    _transpose_lm_head(model.lm_head)
    model.rotary = RotaryEmbedding(config).to(device)  # to_empty emptied its buffer
    return model.eval()


def _transpose_lm_head(lm_head: nn.Linear) -> None:
    """``lm_head.weight [vocab, hidden]`` becomes a view of new ``[hidden, vocab]`` contiguous
    storage (uninitialized: call before loading; a tied lm_head is replaced by the loader)."""
    w = lm_head.weight
    lm_head.weight.data = w.new_empty(w.shape[1], w.shape[0]).t()
