"""The planner's prediction of a candidate P:D for the autoscaler (docs/scaling.md).

:class:`PlannerPredictor` plans the deployment's config with ``prefill.dp`` / ``decode.dp``
set to the candidate's instance counts (``orchestrator.planner.report.plan_config``: the same
figures as ``orch plan``) for the workload measured in the autoscaler's window (mean prompt
and completion tokens, finished requests per second as an open-loop rate) and returns the
operating point's TTFT and TPOT.

Device: an accelerator deployment plans on its platform's default device
(``orchestrator/planner/devices.yaml``); a CPU one on the ``cpu`` calibration cached by
``orch plan --calibrate``, never measured while serving (that starts instances of its own):
without a cached calibration there is no prediction and the autoscaler's table alone decides.
"""

from __future__ import annotations

import logging

from orchestrator.config.errors import ConfigError
from orchestrator.config.schema import OrchConfig
from orchestrator.deploy.autoscaler import LatencyWindow, Prediction
from orchestrator.planner.load import WorkloadSpec
from orchestrator.planner.report import plan_config
from orchestrator.planner.specs import DeviceSpec

log = logging.getLogger(__name__)


def planner_device(cfg: OrchConfig) -> DeviceSpec | None:
    """The device the autoscaler's predictions plan on, or None (logged: why) when there is
    none without measuring: a CPU deployment with no cached calibration, an unknown
    platform."""
    from orchestrator.planner.calibrate import cache_path, cpu_device
    from orchestrator.planner.report import resolve_device

    try:
        if cfg.platform().device_type == "cpu":
            if not cache_path().exists():
                log.info("autoscale: no planner predictions: no cpu calibration cached at %s "
                         "(`orch plan CONFIG --workload in=64,out=16 --calibrate` makes it)",
                         cache_path())
                return None
            return cpu_device()
        return resolve_device(cfg, None)
    except (ValueError, OSError) as exc:
        log.info("autoscale: no planner predictions: %s", exc)
        return None


class PlannerPredictor:
    """counts (role -> instances) -> :class:`Prediction` of that P:D, or None.

    Args:
        cfg: the deployment (its layout per instance; ``dp`` set per candidate).
        window: where the measured workload comes from (:meth:`LatencyWindow.shape`).
        device: what to plan on (None: never predicts).
        min_requests: fewer finished requests in the window: no prediction.
    """

    def __init__(self, cfg: OrchConfig, window: LatencyWindow, device: DeviceSpec | None,
                 min_requests: int = 1) -> None:
        self.cfg, self.window, self.device = cfg, window, device
        self.min_requests = min_requests

    def workload(self) -> WorkloadSpec | None:
        """The measured workload as the planner's :class:`WorkloadSpec` (open-loop rate)."""
        shape = self.window.shape(self.min_requests)
        if shape is None:
            return None
        prompt, completion, rate = shape
        return WorkloadSpec(prompt, completion, rate=rate)

    def __call__(self, counts: dict[str, int]) -> Prediction | None:
        workload = self.workload()
        if self.device is None or workload is None:
            return None
        prefill, decode = counts.get("prefill", 1), counts.get("decode", 1)
        sized = self.cfg.model_copy(update={
            "prefill": self.cfg.prefill.model_copy(update={"dp": prefill}),
            "decode": self.cfg.decode.model_copy(update={"dp": decode})})
        try:
            point = plan_config(sized, workload, self.device).point
        except (ConfigError, ValueError) as exc:
            log.debug("autoscale: no planner prediction of P:D %d:%d: %s", prefill, decode, exc)
            return None
        return Prediction(prefill, decode, point.ttft_s, point.tpot_s)
