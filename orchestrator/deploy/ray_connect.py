"""Joining a Ray cluster (``cluster.address``) or starting orch's own private one.

One place decides which Ray `orch up` runs on: a reachable cluster at ``cluster.address``
(checked first, so an unreachable address or a refused auth token is one line saying what to
do), or an embedded local cluster that belongs to this process alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from engine import envs
from orchestrator.deploy.rank_actors import BringUpError
from orchestrator.config.schema import OrchConfig

log = logging.getLogger(__name__)


def connect_ray(cfg: OrchConfig) -> bool:
    """Join ``cluster.address`` or start an embedded private Ray; True when we started it.

    The embedded Ray is always a new local cluster of this process (``address="local"``,
    ``RAY_ADDRESS`` removed from the environment), never one already running on the host,
    with Ray's default token authentication (``RAY_AUTH_MODE`` unset; its start-up notice is
    not printed).
    The ranks' own output stays in Ray's worker logs (``log_to_driver=False``): orch's log
    gets one line per fault from the router, ``orch up`` says where the worker logs are.

    Raises:
        BringUpError: the cluster is unreachable or refuses this process (one line: what to
            do).
    """
    import ray

    if ray.is_initialized():
        return False
    if cfg.cluster.address:
        _check_reachable(cfg.cluster.address, timeout_s=10.0)
        ray.init(address=cfg.cluster.address, log_to_driver=False)
        return False
    resources = {}
    if cfg.platform().device_type == "npu":
        import torch
        import torch_npu  # noqa: F401

        resources["NPU"] = torch.npu.device_count()
    envs.RAY_ADDRESS.unset()
    # NOTE: Ray warns at every start of a new local cluster that it uses token authentication
    # (its default); the README says so once. Setting RAY_AUTH_MODE=token here instead would
    # not do: Ray's client config was read at import and would still say "disabled".
    quiet_token_auth_notice()
    with daemons_in_own_session():
        ray.init(address="local", num_cpus=os.cpu_count(), resources=resources or None,
                 include_dashboard=False, log_to_driver=False)
    return True


@contextlib.contextmanager
def daemons_in_own_session() -> Iterator[None]:
    """Start the embedded Ray's daemons (GCS, raylet, their agents) outside ``orch up``'s
    process group while the block runs.

    Why: a signal to the whole group (``timeout``, ``kill -TERM -PGID``, a terminal's hang-up)
    reached Ray's daemons as well as ``orch up``. Ray blocks SIGINT in them (so Ctrl-C was
    fine) but not SIGTERM: the raylet and GCS died at once, streams stopped mid-request and
    the drain and stop waited out their bounds (30 s + Ray's 60 s GCS reconnect). Each daemon
    now starts in a session of its own, so the group's SIGTERM reaches ``orch up`` alone,
    which drains and stops Ray. They still die with ``orch up``: Ray's own parent-death
    signal (``fate_share``) and orch's watchdog (:mod:`orchestrator.deploy.ray_watchdog`).
    The ranks are Ray workers started by the raylet, already outside the group.
    """
    import ray._private.services as services

    plain = getattr(services, "ConsolePopen", None)
    if plain is None:  # NOTE: a Ray without it: daemons stay in the group, as before
        log.warning("Ray's process starter moved: its daemons share orch up's process group")
        yield
        return

    class SessionPopen(plain):
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = SessionPopen
    try:
        yield
    finally:
        services.ConsolePopen = plain


_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def quiet_token_auth_notice() -> None:
    """Drop Ray's "Token authentication is enabled" notice of a new local cluster (Ray's
    default; README, Quickstart, says it once) from this process's log."""
    logger = logging.getLogger(_RAY_AUTH_LOGGER)
    if _not_token_auth_notice not in logger.filters:
        logger.addFilter(_not_token_auth_notice)


def _not_token_auth_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled")


def _check_reachable(address: str, timeout_s: float) -> None:
    """Fail fast (bounded) when ``host:port`` of a Ray cluster does not accept connections
    or refuses this process's authentication token.

    Raises:
        BringUpError: nothing listens there within ``timeout_s`` seconds, or the cluster
            requires a token this process does not present.
    """
    import socket

    import ray
    from ray._raylet import GcsClient  # NOTE: the one Ray client that fails in ms, typed

    if address == "auto" or "://" in address or ":" not in address:
        return  # ray resolves these itself
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise BringUpError(
            f"cannot reach the Ray cluster at cluster.address {address!r} within {timeout_s:g} s "
            f"({exc}): start it with `ray start --head` on that node, or fix the address "
            "(empty = embedded local Ray)") from None
    try:
        GcsClient(address=address)
    except ray.exceptions.AuthenticationError:
        raise BringUpError(
            f"the Ray cluster at {address} refused this process's token (InvalidAuthToken): "
            "run `orch up` with RAY_AUTH_MODE=token and the cluster's token (the head's "
            "~/.ray/auth_token, or RAY_AUTH_TOKEN), as in the README's multi-node recipe") from None
    except ray.exceptions.RpcError as exc:
        raise BringUpError(
            f"{address} accepts connections but no Ray cluster answered there ({exc}): give "
            "cluster.address as the head's IP and `ray start --head --port`") from None
