"""The graph mode sections of the `orch up` configuration: ``decode.graph`` (the decode
forward captured per batch-size bucket, engine/graph.py) and ``prefill.graph`` (prefill-only
steps compiled once, engine/prefill_graph.py); docs/config.md is the reference."""

from __future__ import annotations

from pydantic import Field, model_validator

from engine.graph import GraphConfig
from engine.prefill_graph import PrefillGraphConfig
from orchestrator.config.section_base import _cross_field, _Section


class GraphSection(_Section):
    """Graph mode of the decode forward (engine/graph.py): decode-only steps of up to
    ``max(batch_sizes)`` sequences run a forward captured once per batch-size bucket; all
    other steps run eager. vLLM's ``enforce_eager`` is ``enabled: false``, its
    ``cuda_graph_sizes`` is ``batch_sizes``."""

    enabled: bool = False
    batch_sizes: list[int] = Field(default_factory=lambda: list(GraphConfig.batch_sizes),
                                   min_length=1)
    # Capture every bucket when the instance starts (else on a bucket's first use).
    warmup: bool = False
    # Capture backend ("compile", "cudagraph", "npugraph"); "" = the device type's default.
    backend: str = ""
    # A bucket that cannot be captured stops the instance (with warmup: at start-up) instead
    # of running eager (which is logged, and listed in the runner's graph status).
    required: bool = False

    @model_validator(mode="after")
    def _sizes_increase(self) -> "GraphSection":
        try:
            self.graph_config()
        except ValueError as exc:
            raise _cross_field(f"decode.graph: {exc}") from None
        return self

    def graph_config(self, max_num_seqs: int | None = None) -> GraphConfig:
        """The :class:`engine.graph.GraphConfig` the decode (or colocated) runners get; with
        ``max_num_seqs`` (the instance's batch cap) every bucket above it becomes
        ``max_num_seqs``: no step is padded past the batch cap and warmup captures no bucket
        a step cannot use."""
        sizes = self.batch_sizes if max_num_seqs is None else \
            sorted({min(size, max_num_seqs) for size in self.batch_sizes})
        return GraphConfig(enabled=self.enabled, batch_sizes=tuple(sizes),
                           warmup=self.warmup, backend=self.backend or None,
                           required=self.required)


class PrefillGraphSection(_Section):
    """Graph mode of prefill-only steps (engine/prefill_graph.py): the layers compiled once
    with a dynamic token count; steps with decode rows, one-token steps and steps that send KV
    layer by layer run eager. Prefill and colocated instances; dense MLA (DeepSeek-V2/V3)
    without cp, ep or speculative decoding."""

    enabled: bool = False
    # Compile when the instance starts (10-20 s on a CPU), else on the first prefill step.
    warmup: bool = True
    # Capture backend ("compile"); "" = the device type's default.
    backend: str = ""
    # A failed capture stops the instance instead of running prefill eager (logged).
    required: bool = False

    @model_validator(mode="after")
    def _known_backend(self) -> "PrefillGraphSection":
        try:
            self.graph_config()
        except ValueError as exc:
            raise _cross_field(f"prefill.graph: {exc}") from None
        return self

    def graph_config(self) -> PrefillGraphConfig:
        """The :class:`engine.prefill_graph.PrefillGraphConfig` the runners get."""
        return PrefillGraphConfig(enabled=self.enabled, warmup=self.warmup,
                                  backend=self.backend or None, required=self.required)
