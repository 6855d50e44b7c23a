"""What every config section shares: a strict frozen pydantic model, and the error a check
across its fields raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError


class _Section(BaseModel):
    # NOTE: strict: `tp: true` or `tp: "2"` are errors, not 1 and 2; no inf/nan durations.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _cross_field(message: str) -> PydanticCustomError:
    return PydanticCustomError("cross_field", message)
