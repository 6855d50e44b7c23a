"""What the router reports about requests and instances: the :class:`RouterMetrics`
protocol (``orchestrator.metrics.RouterMetrics`` implements it with prometheus-client) and
:class:`NoMetrics`, the default that reports nothing."""

from __future__ import annotations

from typing import Protocol

from rank.messages import InstanceStatusInfo


class RouterMetrics(Protocol):
    """What the router reports; ``orchestrator.metrics.RouterMetrics`` implements it. Each
    request is reported exactly once: ``request_rejected`` when it failed before anything
    was computed, else ``request_finished``."""

    def request_finished(self, outcome: str, ttft_s: float | None, tpot_s: float | None,
                         e2e_s: float, prompt_tokens: int, completion_tokens: int) -> None: ...

    def request_rejected(self, code: str) -> None: ...

    def update_instances(self, statuses: list[InstanceStatusInfo]) -> None: ...

    def request_migrated(self) -> None: ...

    def first_token(self, phases: tuple[tuple[str, float], ...]) -> None: ...


class NoMetrics:
    """The default: report nothing."""

    def request_finished(self, outcome: str, ttft_s: float | None, tpot_s: float | None,
                         e2e_s: float, prompt_tokens: int, completion_tokens: int) -> None:
        pass

    def request_rejected(self, code: str) -> None:
        pass

    def update_instances(self, statuses: list[InstanceStatusInfo]) -> None:
        pass

    def request_migrated(self) -> None:
        pass

    def first_token(self, phases: tuple[tuple[str, float], ...]) -> None:
        pass
