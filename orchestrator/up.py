"""`orch up`: checkpoint, Ray instances, router and gRPC server, until SIGINT/SIGTERM.

Stop order: health NOT_SERVING, drain in-flight requests (bounded by ``DRAIN_S``), server
stop, then the Ray actors (leaders' drain and shutdown bounded by ``TEARDOWN_S`` each, then
killed) and placement groups, then Ray itself if we started it.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from orchestrator.assemble import build_router
from orchestrator.checkpoint import ensure_checkpoint, read_model_info
from orchestrator.cluster import Cluster, bring_up, connect_ray
from orchestrator.config import OrchConfig
from orchestrator.detokenizer import Tokenizer
from orchestrator.server import OrchServer, PortInUseError

log = logging.getLogger(__name__)
DRAIN_S = 30.0
# NOTE: after the router's drain, the leaders' drain and shutdown get this bound each, then
# every rank is killed: a rank stuck in a failing transfer must not hold the exit.
TEARDOWN_S = 5.0


def make_metrics(cfg: OrchConfig):
    """The prometheus RouterMetrics when ``router.metrics_port`` is set and it is installed."""
    if cfg.router.metrics_port is None:
        return None
    try:
        from orchestrator.metrics import RouterMetrics
    except ImportError as exc:
        log.warning("router.metrics_port is set but metrics are unavailable (%s)", exc)
        return None
    return RouterMetrics(cfg.router.host, cfg.router.metrics_port)


def _check_ports_free(cfg: OrchConfig) -> None:
    """Fail before the (slow) bring-up when the router or metrics port is taken.

    Raises:
        PortInUseError: names the key and what to do.
    """
    import socket

    for key, port in (("router.port", cfg.router.port),
                      ("router.metrics_port", cfg.router.metrics_port)):
        if not port:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((cfg.router.host, port))
            except OSError as exc:
                raise PortInUseError(f"{key} {port} on {cfg.router.host} is not free ({exc}): "
                                   f"stop what uses it or pick another {key}") from None


def run_up(cfg: OrchConfig, rank_classes: dict[str, type] | None = None) -> int:
    """Bring everything up and serve until SIGINT/SIGTERM; returns the exit code.

    Args:
        cfg: the deployment.
        rank_classes: role -> rank class (default: the real worker classes; tests inject
            fakes).
    """
    _check_ports_free(cfg)
    checkpoint = ensure_checkpoint(cfg.model)
    model = read_model_info(checkpoint, cfg.model.path, cfg.model.max_model_len)
    tokenizer = Tokenizer(checkpoint) if (checkpoint / "tokenizer.json").is_file() else None
    if tokenizer is None:
        log.warning("%s has no tokenizer.json: only token-id prompts will work", checkpoint)
    started = connect_ray(cfg)
    cluster = bring_up(cfg, rank_classes=rank_classes, started_ray=started)
    try:
        asyncio.run(_serve(cfg, cluster, model, tokenizer))
    finally:
        cluster.teardown(timeout_s=TEARDOWN_S)
    return 0


async def _serve(cfg: OrchConfig, cluster: Cluster, model, tokenizer) -> None:
    metrics = make_metrics(cfg)
    router = build_router(cfg, cluster.leaders(), model, tokenizer, metrics)
    server = OrchServer(router, cfg.router.host, cfg.router.port)
    port = await server.start()
    reporter = asyncio.create_task(router.report_instances(period_s=1.0))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    metrics_at = f"; metrics on :{cfg.router.metrics_port}/metrics" if metrics else ""
    print(f"orch serving {model.name} on {cfg.router.host}:{port} "
          f"({len(cluster.instances)} instance(s)){metrics_at}; Ctrl-C to stop", flush=True)
    await stop.wait()
    print("orch: stopping (draining in-flight requests)", flush=True)
    reporter.cancel()
    await asyncio.gather(reporter, return_exceptions=True)
    await server.stop(grace_s=DRAIN_S)
    if metrics is not None and hasattr(metrics, "stop"):
        metrics.stop()
