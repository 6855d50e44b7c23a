"""A device with its kernel efficiencies applied: the achieved rates the cost terms divide by.

:class:`Hardware` turns a :class:`.specs.DeviceSpec` (peaks, HBM and link bandwidths, kernel
efficiencies) into FLOP/s of the linears and of attention, bytes/s of HBM and of a
collective's link, and the link latency. The linears run at the 8-bit peak when they are
stored in one byte (:func:`eight_bit`: FP8 where the device has it, else INT8), else at the
bf16 peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config.memory_plan import Precision
from orchestrator.planner.specs import DeviceSpec

GBPS = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    """A device with its kernel efficiencies applied: achieved rates in bytes/s, FLOP/s."""

    spec: DeviceSpec

    def gemm_flops(self, prec: Precision) -> float:
        """FLOP/s of the linears: 1-byte weights at the FP8 peak (else INT8: W8A8), else the
        bf16 peak (cpu: the measured rate at the model dtype)."""
        s, k = self.spec, self.spec.kernels
        if eight_bit(prec):
            if s.fp8_tflops > 0:
                return s.fp8_tflops * TFLOPS * k.gemm_fp8
            return s.int8_tflops * TFLOPS * k.gemm_int8
        return s.bf16_tflops * TFLOPS * k.gemm_bf16

    def attn_flops(self, decode: bool, mha_keys: float = 0.0) -> float:
        """FLOP/s of attention: decode's kernel, else prefill's; a causal prefill in MHA
        form whose queries see ``mha_keys`` keys on average (> 0) at the device's causal
        figure for sequences of ``2 x mha_keys`` tokens (a causal sequence of L tokens:
        (L + 1) / 2 keys a query on average)."""
        k = self.spec.kernels
        if decode:
            eff = k.attn_decode
        else:
            eff = k.causal_prefill(2 * mha_keys) if mha_keys > 0 else k.attn_prefill
        return self.spec.bf16_tflops * TFLOPS * eff

    def hbm(self, kind: str = "weights_hbm") -> float:
        return self.spec.hbm_gb_s * GBPS * getattr(self.spec.kernels, kind)

    @property
    def latency_s(self) -> float:
        return self.spec.link_latency_us * 1e-6

    def link(self, group: int) -> float:
        """Bytes/s per rank of a collective over ``group`` ranks (the inter-domain link once
        it spans more than one scale-up domain)."""
        gb_s = self.spec.intra_domain_gb_s if group <= self.spec.domain_ranks \
            else self.spec.inter_domain_gb_s
        return gb_s * GBPS * self.spec.kernels.link


def eight_bit(prec: Precision) -> bool:
    """Linears stored in one byte (FP8 / INT8; their block scales add a few bytes per
    thousand weights: ~1.0002 bytes per weight, :func:`engine.quant.memory.bytes_per_param`)."""
    return prec.linear < 1.5
