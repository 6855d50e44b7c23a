"""`orch up`: checkpoint, Ray instances, router, gRPC server and (``router.http_port``) the
OpenAI HTTP API on the same router, until SIGINT/SIGTERM. With ``router.replicas: N`` the
router here is replica 0 and N-1 more serve the same ports (orchestrator/deploy/replicas.py).

Start-up prints one line per stage and instance (:mod:`orchestrator.deploy.progress`); SIGINT or
SIGTERM during it stops what was started and ends the command (exit 130 from the CLI).
Stop order once serving: health NOT_SERVING and the HTTP server stops accepting, drain
in-flight requests (bounded by ``DRAIN_S``), servers stop, then the Ray actors (leaders' drain and shutdown bounded by
``TEARDOWN_S`` each, then killed) and placement groups, then Ray itself if we started it. An
embedded Ray is also stopped when `orch up` is killed outright (its watchdog,
:mod:`orchestrator.deploy.ray_watchdog`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from dataclasses import replace

from engine import envs
from orchestrator.deploy.assemble import (build_board, build_http_server, build_monitor,
                                          build_reports, build_router)
from orchestrator.config.checkpoint import ensure_checkpoint, read_model_info
from orchestrator.deploy.cluster import Cluster, bring_up
from orchestrator.config.schema import OrchConfig
from orchestrator.router.detokenizer import Tokenizer
from orchestrator.config.memory_check import check_memory
from orchestrator.deploy.progress import Stopwatch, node_ips, plural, say
from orchestrator.deploy.ray_connect import connect_ray
from orchestrator.deploy.ray_watchdog import start_watchdog, stop_watchdog
from orchestrator.deploy.recovery import Recoverer
from orchestrator.deploy.autoscaler import LatencyWindow, WindowedMetrics
from orchestrator.deploy.scaling import Scaler, build_autoscaler
from orchestrator.router.metrics_sink import NoMetrics
from orchestrator.api.admin import AdminServicer
from orchestrator.api.security import EdgeSecurity, load_security
from orchestrator.api.server import OrchServer, PortInUseError
from orchestrator.deploy.replicas import NoLiveScaling, ReplicaSet
from orchestrator.router.peers import Peers
from rank.rank import Rank

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
    return RouterMetrics(cfg.router.metrics_host, cfg.router.metrics_port)


def check_ports_free(cfg: OrchConfig) -> None:
    """Fail before the (slow) bring-up when the router, metrics or HTTP port is taken.

    Binds each port the way the real servers do (``SO_REUSEADDR``, as gRPC and the metrics
    HTTP server set it): a TIME_WAIT left by a closed connection (a /metrics scrape of the
    last run) does not block, a live listener does.

    Raises:
        PortInUseError: names the key and what to do.
    """
    for key, host, port in (("router.port", cfg.router.host, cfg.router.port),
                            ("router.metrics_port", cfg.router.metrics_host,
                             cfg.router.metrics_port),
                            ("router.http_port", cfg.router.host, cfg.router.http_port)):
        if not port:
            continue
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise PortInUseError(f"{key} {port} on {host} is not free ({exc}): "
                                     f"stop what uses it or pick another {key}") from None


def run_up(cfg: OrchConfig, roles: dict[str, type] | None = None,
           rank_class: type = Rank) -> int:
    """Bring everything up and serve until SIGINT/SIGTERM; returns the exit code.

    Args:
        cfg: the deployment.
        roles, rank_class: the role classes by role name (default: the workers') and the rank
            actor class (tests inject fakes), as :func:`bring_up` takes them.

    Raises:
        ConfigError: ``router.tls`` / ``router.auth`` point at something unusable, or the
            memory plan does not fit the devices (checked first, before anything starts).
        KeyboardInterrupt: SIGINT or SIGTERM before serving began; what was started (ranks,
            placement groups, the embedded Ray) is stopped first.
    """
    say(check_memory(cfg))
    security = load_security(cfg.router)
    check_ports_free(cfg)
    # NOTE: the metrics server binds its port now, before Ray, gloo and the step channels
    # open hundreds of ephemeral ports during bring-up: a free port checked above and bound
    # only after them could be taken in between.
    metrics = make_metrics(cfg)
    try:
        _run_cluster(cfg, roles, rank_class, security, metrics)
    finally:
        if metrics is not None and hasattr(metrics, "stop"):
            metrics.stop()
    return 0


def _run_cluster(cfg: OrchConfig, roles: dict[str, type] | None, rank_class: type,
                 security: EdgeSecurity, metrics) -> None:
    """:func:`run_up` after the checks: read the model, start Ray and the ranks, serve."""
    checkpoint = ensure_checkpoint(cfg.model)
    model = replace(read_model_info(checkpoint, cfg.model.path, cfg.model.max_model_len),
                    num_speculative_tokens=cfg.decode.num_speculative_tokens)
    tokenizer = Tokenizer(checkpoint) if (checkpoint / "tokenizer.json").is_file() else None
    if tokenizer is None:
        log.warning("%s has no tokenizer.json: only token-id prompts will work", checkpoint)
    import ray

    # NOTE: until _serve's handlers take over. SIGINT too: a shell starts a background job
    # with SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    owns_ray = not ray.is_initialized()
    # NOTE: an embedded Ray only; started before ray.init so that a kill -9 even during it
    # leaves nothing behind (orchestrator/deploy/ray_watchdog.py).
    watchdog = start_watchdog() if owns_ray and not cfg.cluster.address else None
    cluster = None
    try:
        # NOTE: inside the try: an interrupt in ray.init still shuts down what it started.
        cluster = bring_up(cfg, roles=roles, rank_class=rank_class,
                           started_ray=_start_ray(cfg))
        asyncio.run(_serve(cfg, cluster, model, tokenizer, security, checkpoint, metrics))
    finally:
        if cluster is not None:
            cluster.teardown(timeout_s=TEARDOWN_S)
        elif owns_ray:
            ray.shutdown()
        if watchdog is not None:
            stop_watchdog(watchdog)


def _interrupt(signum: int, frame: object) -> None:
    """SIGINT or SIGTERM during start-up: stop what started (a default SIGTERM would leave Ray
    behind)."""
    raise KeyboardInterrupt(f"signal {signum}")


def _start_ray(cfg: OrchConfig) -> bool:
    """:func:`connect_ray` with progress lines; True when it started an embedded Ray."""
    if not sys.stdout.isatty():
        envs.RAY_COLOR_PREFIX.set_default("0")
    where = f"joining the Ray cluster at {cfg.cluster.address}" if cfg.cluster.address \
        else "starting an embedded Ray (a private local cluster)"
    say(where)
    watch = Stopwatch()
    started = connect_ray(cfg)
    say(f"Ray ready in {watch}: {plural(len(node_ips()), 'node')}; rank logs in "
        f"{_worker_logs_dir()} on each node (worker-*.err and worker-*.out)")
    return started


def _worker_logs_dir() -> str:
    """Where Ray writes the rank processes' logs on this node."""
    import ray

    # NOTE: Ray has no public accessor for it; the session's folder is the one to look in
    # (session_latest may belong to another Ray on a shared host).
    node = getattr(ray._private.worker, "_global_node", None)
    return node.get_logs_dir_path() if node is not None else "/tmp/ray/session_latest/logs"


async def _serve(cfg: OrchConfig, cluster: Cluster, model, tokenizer,
                 security: EdgeSecurity, checkpoint, metrics) -> None:
    # NOTE: the monitor tells the router (built next) about failures and has the recoverer
    # (built on the router's leader clients, which it rebinds) restart the instance.
    # NOTE: the leaders' own reports on their streams (the router's pump fills them): the
    # monitor pings only instances not heard alive lately, the board shows their statuses.
    reports = build_reports(cfg)
    monitor = build_monitor(cfg, cluster.ranks_of, reports=reports,
                            on_unhealthy=lambda name, why: router.fleet.instance_failed(name, why),
                            recover=(lambda name: recoverer.recover(name))
                            if cfg.health.max_restarts else None,
                            restart_wait=lambda name: recoverer.restart_wait(name))
    if metrics is not None:
        metrics.track_health(monitor)
    window = LatencyWindow(cfg.autoscale.window_s) if cfg.autoscale else None
    router = build_router(cfg, cluster.leaders(), model, tokenizer,
                          WindowedMetrics(metrics or NoMetrics(), window) if window else metrics,
                          health=monitor, reports=reports)
    if metrics is not None:
        metrics.track_router_load(lambda: router.flow.pools)
    clients = {leader.name: leader for leader in router.flow.leaders}  # NOTE: scaling edits it
    recoverer = Recoverer(cluster, clients, max_restarts=cfg.health.max_restarts,
                          window_s=cfg.health.restart_window_s,
                          timeout_s=cfg.health.recover_timeout_s)
    board = build_board(cfg, router, monitor)
    scaler = Scaler(cfg, cluster, router, monitor, clients)
    shared = cfg.router.replicas > 1  # NOTE: every replica binds the ports with SO_REUSEPORT
    peers = Peers()
    server = OrchServer(router, board, cfg.router.host, cfg.router.port, security,
                        cfg.router.max_message_bytes,
                        admin=NoLiveScaling() if shared else AdminServicer(scaler), peers=peers,
                        reuse_port=shared)
    port = await server.start()
    http, http_port = None, None
    replicas = ReplicaSet(router, monitor, cluster.leaders, peers) if shared else None
    try:
        if cfg.router.http_port is not None:
            http = build_http_server(cfg, router, checkpoint, security.token,
                                     ready=lambda: server.serving, grace_s=DRAIN_S,
                                     retry_after=monitor.retry_after_s, reuse_port=shared)
            http_port = await http.start()
        if replicas is not None:
            bound = cfg.router.model_copy(update={"port": port, "http_port": http_port})
            await replicas.start(cfg.model_copy(update={"router": bound}), model, checkpoint,
                                 security, metrics is not None, DRAIN_S)
    except BaseException:
        await _stop_servers(server, http, replicas)
        raise
    reporter = asyncio.create_task(board.report(period_s=1.0))
    autoscaler = (asyncio.create_task(build_autoscaler(cfg.autoscale, router, scaler, window,
                                                       metrics).run())
                  if window else None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    metrics_at = (f"; metrics on {cfg.router.metrics_host}:{cfg.router.metrics_port}/metrics"
                  if metrics else "")
    http_at = (f"; OpenAI API on http{'s' if cfg.router.tls else ''}://{cfg.router.host}:"
               f"{http_port}/v1" if http else "")
    replicas_at = f", {cfg.router.replicas} router replicas" if shared else ""
    print(f"orch serving {model.name} on {cfg.router.host}:{port}, {security.describe()} "
          f"({len(cluster.instances)} instance(s){replicas_at}){metrics_at}{http_at}; "
          "Ctrl-C to stop", flush=True)
    await stop.wait()
    print("orch: stopping (draining in-flight requests)", flush=True)
    for task in (reporter, autoscaler):
        if task is not None:
            task.cancel()
    await asyncio.gather(*(t for t in (reporter, autoscaler) if t), return_exceptions=True)
    await _stop_servers(server, http, replicas)


async def _stop_servers(server: OrchServer, http, replicas: ReplicaSet | None) -> None:
    """Drain and stop every router replica's servers together (each bounded by DRAIN_S)."""
    stops = [server.stop(grace_s=DRAIN_S)] + ([http.stop()] if http else [])
    if replicas is not None:
        stops.append(replicas.stop(DRAIN_S))
    await asyncio.gather(*stops)
