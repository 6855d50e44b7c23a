"""Device ``mla_decode`` kernels: FlashInfer on CUDA, ``torch_npu`` on Ascend.

Same contract as :func:`engine.mla_ops.decode_absorbed` (q_nope ``[B, H, P]``, q_pe
``[B, H, R]``, k_cache ``[num_blocks, block_size, L]``, v_cache ``[num_blocks, block_size, R]``,
a :class:`DecodeBatch`, w_uk ``[H, P, L]``, w_uv ``[H, V, L]``, scale -> ``[B, H, V]``): the
query is absorbed (``q_lat = q_nope W_UK``), the kernel attends over c_kv plus k_pe in place
through the block table, and the latent output goes through W_UV.

NOTE: UNTESTED OFF-DEVICE, written from the documented signatures (FlashInfer
``flashinfer.mla.BatchMLAPagedAttentionWrapper``; ``torch_npu.npu_fused_infer_attention_score``
as vLLM-Ascend's MLA decode calls it). Imported only when resolved on its device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.forward_context import DecodeBatch

FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024
"""Float workspace of the FlashInfer wrapper (the size FlashInfer's docs recommend)."""


class FlashInferMLADecode:
    """``mla_decode`` on CUDA with FlashInfer's paged MLA kernel (untested off-device).

    One instance per resolved :class:`engine.kernels.KernelSet` (one runner). The wrapper is
    planned once per :class:`DecodeBatch` (the first layer of a step) and the plan is reused
    by the other layers, which share the batch object.
    """

    def __init__(self) -> None:
        import flashinfer  # noqa: PLC0415 (lazy: only where FlashInfer is installed)

        self._flashinfer = flashinfer
        self._wrapper = None
        self._planned: DecodeBatch | None = None

    def __call__(self, q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, batch: DecodeBatch, w_uk: torch.Tensor,
                 w_uv: torch.Tensor, scale: float) -> torch.Tensor:
        q_lat = torch.einsum("bhp,hpl->bhl", q_nope, w_uk).contiguous()  # [B, H, L]
        if self._wrapper is None:
            workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.int8,
                                    device=q_nope.device)
            self._wrapper = self._flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)
        if self._planned is not batch:
            self._plan(batch, q_lat, k_cache, v_cache, scale)
        o_lat = self._wrapper.run(q_lat, q_pe.contiguous(), k_cache, v_cache)  # [B, H, L]
        return torch.einsum("bhl,hvl->bhv", o_lat, w_uv)

    def _plan(self, batch: DecodeBatch, q_lat: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, scale: float) -> None:
        """CSR page lists of the batch (FlashInfer's layout): sequence b's pages are
        ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``."""
        b, h, block_size = q_lat.shape[0], q_lat.shape[1], k_cache.shape[1]
        pages = (batch.seq_lens + block_size - 1) // block_size  # [B]
        used = torch.arange(batch.block_table.shape[1], device=pages.device) < pages[:, None]
        kv_indptr = torch.nn.functional.pad(pages.cumsum(0), (1, 0)).to(torch.int32)
        qo_indptr = torch.arange(b + 1, dtype=torch.int32, device=pages.device)
        self._wrapper.plan(qo_indptr, kv_indptr, batch.block_table[used].to(torch.int32),
                           batch.seq_lens.to(torch.int32), h, k_cache.shape[-1],
                           v_cache.shape[-1], block_size, False, scale, q_lat.dtype,
                           k_cache.dtype)
        self._planned = batch


def load_flashinfer_decode() -> Callable:
    """Registry loader of :class:`FlashInferMLADecode` (imports flashinfer)."""
    return FlashInferMLADecode()


def load_npu_decode() -> Callable:
    """Registry loader of the Ascend ``mla_decode`` (imports torch_npu; untested off-device)."""
    import torch_npu  # noqa: PLC0415 (lazy: only on Ascend)

    def mla_decode_npu(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, batch: DecodeBatch, w_uk: torch.Tensor,
                       w_uv: torch.Tensor, scale: float) -> torch.Tensor:
        """``npu_fused_infer_attention_score`` in BNSD layout over the paged caches viewed
        ``[num_blocks, 1 kv head, block_size, width]`` (vLLM-Ascend's MLA decode call)."""
        b, h, block_size = q_nope.shape[0], q_nope.shape[1], k_cache.shape[1]
        lora, rope = k_cache.shape[-1], v_cache.shape[-1]
        q_lat = torch.einsum("bhp,hpl->bhl", q_nope, w_uk)  # [B, H, L]
        k_nope = k_cache.view(-1, 1, block_size, lora)
        # NOTE: the op takes the kv lengths as a host list: one device->host copy per call.
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q_lat.view(b, h, 1, lora), k_nope, k_nope, query_rope=q_pe.reshape(b, h, 1, rope),
            key_rope=v_cache.view(-1, 1, block_size, rope), num_heads=h,
            num_key_value_heads=1, input_layout="BNSD", scale=scale, antiquant_mode=0,
            antiquant_scale=None, block_table=batch.block_table.to(torch.int32),
            block_size=block_size, actual_seq_lengths_kv=batch.seq_lens.tolist())
        return torch.einsum("bhl,hvl->bhv", out.view(b, h, lora), w_uv)

    return mla_decode_npu
