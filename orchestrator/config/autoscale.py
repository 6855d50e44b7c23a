"""The optional ``autoscale`` section: targets and bounds of the autoscaler
(``orchestrator/deploy/autoscaler.py``, docs/scaling.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from orchestrator.config.sections import _Section, _cross_field


class RoleBounds(_Section):
    """Fewest and most instances the autoscaler may leave a role with."""

    min: int = Field(1, ge=1)
    max: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> "RoleBounds":
        if self.min > self.max:
            raise _cross_field(f"autoscale bounds: min ({self.min}) is above max ({self.max})")
        return self


class AutoscaleSection(_Section):
    """Every ``interval_s`` seconds the autoscaler compares the p90 TTFT and TPOT of the
    requests that finished in the last ``window_s`` seconds, and the requests waiting for decode
    KV blocks, with the targets, and adds or removes one instance of one role; never two
    changes within ``cooldown_s``, never outside a role's bounds. A role scales down only when
    every measure is under ``scale_down_fraction`` of its target and nothing waits.

    Attributes:
        ttft_p90_s, tpot_p90_s: targets, seconds (TTFT over: prefill; TPOT over: decode).
        max_waiting: requests waiting for decode KV blocks above which decode is added.
        min_requests: fewer finished requests in the window: latencies are not judged.
    """

    ttft_p90_s: float = Field(gt=0)
    tpot_p90_s: float = Field(gt=0)
    interval_s: float = Field(10.0, gt=0)
    window_s: float = Field(30.0, gt=0)
    cooldown_s: float = Field(60.0, ge=0)
    scale_down_fraction: float = Field(0.5, gt=0, lt=1)
    max_waiting: int = Field(0, ge=0)
    min_requests: int = Field(5, ge=1)
    prefill: RoleBounds = RoleBounds()
    decode: RoleBounds = RoleBounds()
