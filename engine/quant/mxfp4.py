"""MXFP4 (OCP Microscaling FP4) weights as DeepSeek-V4 stores its routed experts
(``expert_dtype: fp4``).

A weight ``W [out, in]`` is stored as ``packed [out, in / 2]`` (one byte per two weights:
``float4_e2m1fn_x2``, or int8 / uint8 holding the same bytes) and ``scale [out, in / 32]``
(``float8_e8m0fnu``: a power of two ``2^(byte - 127)``; raw uint8 exponent bytes are read the
same way; a float scale is used as is). Byte ``packed[r, j]`` holds column ``2j`` in its low
nibble and column ``2j + 1`` in its high nibble; a nibble is an e2m1 code (sign bit 3,
exponent bits 2-1, mantissa bit 0) with the values of :data:`E2M1_VALUES`;
``W[r, c] = e2m1(nibble of c) * scale[r, c // 32]``.

Sources (docs/quantization.md "DeepSeek-V4"): DeepSeek's V4 inference ``model.py`` as public
ports vendor it (``Linear`` with ``dtype == torch.float4_e2m1fn_x2``: ``weight [out, in //
2]`` and ``scale [out, in // fp4_block_size]`` float8_e8m0fnu, ``fp4_block_size = 32``; the
experts' scale is ``<module>.scale``); transformers 5.23
``integrations/finegrained_fp8.py`` (``Fp8Dequantize._FP4_E2M1_LUT`` / ``_unpack_fp4``: low
nibble first; ``FP8Experts``: int8 weight with K halved, one scale per row per 32); the OCP
Microscaling Formats (MX) v1.0 spec for the e2m1 and e8m0 encodings.
"""

from __future__ import annotations

import torch

MXFP4_BLOCK = 32  # weights per e8m0 scale, along the input dim
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each e2m1 code 0..15 (OCP MX v1.0: bias 1, code 1 subnormal 0.5, no inf/NaN)."""
PACKED_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
"""Dtypes a packed MXFP4 weight is stored in (the same bytes)."""


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor,
                     block: int = MXFP4_BLOCK) -> torch.Tensor:
    """Float32 ``[..., out, in]`` weight of MXFP4 ``packed [..., out, in / 2]`` (a dtype of
    :data:`PACKED_DTYPES`; low nibble = even column) and ``scale [..., out, in / block]``
    (float8_e8m0fnu, raw e8m0 uint8 exponents, or float). Exact: every result is an e2m1
    value times a power of two (module doc for the format and its sources).

    Raises:
        ValueError: ``packed`` is not one of :data:`PACKED_DTYPES`; ``scale``'s shape is not
            ``[..., out, 2 * packed.shape[-1] / block]``; an e8m0 scale is NaN (byte 0xFF).
    """
    if packed.dtype not in PACKED_DTYPES:
        raise ValueError(f"packed MXFP4 weight has dtype {packed.dtype}; one of "
                         f"{PACKED_DTYPES} (two e2m1 codes per byte) is expected")
    cols = 2 * packed.shape[-1]
    want = (*packed.shape[:-1], -(-cols // block))
    if tuple(scale.shape) != want:
        raise ValueError(f"MXFP4 scale has shape {tuple(scale.shape)}; packed weight "
                         f"{tuple(packed.shape)} ({cols} columns, one scale per {block}) "
                         f"needs {want}")
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        exponent = scale.view(torch.uint8)
        if bool((exponent == 0xFF).any()):
            raise ValueError("MXFP4 scale holds e8m0 NaN (0xFF)")
        factor = torch.exp2(exponent.float() - 127.0)
    else:
        factor = scale.float()
    byte = packed.view(torch.uint8).long()
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = torch.stack((table[byte & 0xF], table[byte >> 4]), dim=-1).flatten(-2)
    return values * factor.repeat_interleave(block, dim=-1)[..., :cols]



class Mxfp4Experts(torch.nn.Module):
    """A stack of ``E`` MXFP4 expert weights kept packed as the checkpoint stores them
    (DeepSeek-V4's routed experts, ``expert_dtype: fp4``): ``experts[e]`` is expert ``e``'s
    float32 ``[out, in]`` (:func:`dequantize_mxfp4` at use: exact, the same values as
    dequantizing at load).

    Buffers: ``weight`` uint8 ``[E, out, in / 2]`` (two e2m1 codes a byte, low nibble first)
    and ``scale`` uint8 ``[E, out, in / 32]`` (e8m0 exponent bytes): 0.53 bytes a weight.
    """

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty(num_experts, out_features, in_features // 2,
                                                   dtype=torch.uint8))
        self.register_buffer("scale", torch.empty(
            num_experts, out_features, -(-in_features // MXFP4_BLOCK), dtype=torch.uint8))

    def __getitem__(self, e: int) -> torch.Tensor:
        """Expert ``e``'s weight ``[out, in]``, float32."""
        return dequantize_mxfp4(self.weight[e], self.scale[e], MXFP4_BLOCK)
