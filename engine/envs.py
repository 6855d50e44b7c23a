"""Every environment variable orch reads or sets, declared once (name, type, default, meaning).

Nothing else reads ``os.environ`` for these: call ``ORCH_TORCH_THREADS.get()`` and so on.
This module sits at the bottom of the import graph (standard library only), so the client,
the control plane and the ranks can all use it. docs/config.md ("Environment") lists the same
variables; a test keeps the two in step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable.

    Attributes:
        name: the variable's name.
        parse: turns the raw (non-empty) text into a value; raises ValueError when it cannot.
        default: the value when the variable is unset or empty.
        doc: what it changes, for docs/config.md.
    """

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str

    def get(self) -> T:
        """The current value (``default`` when unset or empty).

        Raises:
            ValueError: the text does not parse; the message names the variable and the fix.
        """
        raw = os.environ.get(self.name, "")
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"environment variable {self.name}={raw!r} is invalid: {exc}; "
                             f"fix it or unset it ({self.doc})") from None

    def set_default(self, value: str) -> None:
        """Set the variable for this process and its children unless it is already set
        (empty counts as unset)."""
        if not os.environ.get(self.name):
            os.environ[self.name] = value

    def unset(self) -> None:
        """Remove the variable from this process's environment (and its future children's)."""
        os.environ.pop(self.name, None)


def set_library_env(values: dict[str, str]) -> None:
    """Set variables a library reads when it builds its next object (NCCL / HCCL error
    handling of a communicator, ``kv_transfer.backend.COMM_SETTINGS``): orch's choice, set
    for this process whatever was there. Documented where the settings are."""
    os.environ.update(values)


def read_configured(name: str) -> str:
    """The value of a variable whose name is itself configuration (``router.auth.token_env``),
    "" when unset. Documented where that key is, not in :data:`ALL`."""
    return os.environ.get(name, "")


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def _nice(raw: str) -> int | None:
    value = int(raw)
    if not -20 <= value <= 19:
        raise ValueError(f"must be a nice value in [-20, 19], got {value}")
    return value


def _log_level(raw: str) -> str:
    value = raw.upper()
    if value not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
    return value


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value not in ("1", "true", "0", "false"):
        raise ValueError("must be 1 / true or 0 / false")
    return value in ("1", "true")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

ORCH_CACHE_DIR: EnvVar[str] = EnvVar(
    "ORCH_CACHE_DIR", str, "",
    "folder of the built-in tiny checkpoint when model.tiny_dir is empty; "
    "unset: ~/.cache/orch")
ORCH_DEVICE: EnvVar[str] = EnvVar(
    "ORCH_DEVICE", str, "",
    "device type 'npu', 'cuda' or 'cpu' used instead of detecting one, wherever "
    "engine.platform decides (cluster.device auto with backend auto; a model runner built "
    "without a device); unset: detect")
ORCH_TORCH_THREADS: EnvVar[int] = EnvVar(
    "ORCH_TORCH_THREADS", _positive_int, 1,
    "torch intra-op threads of each rank process (torch.set_num_threads)")
ORCH_RANK_NICE: EnvVar[int | None] = EnvVar(
    "ORCH_RANK_NICE", _nice, None,
    "nice value every rank process sets for its threads at start (e.g. 0: Ray starts workers "
    "at 15); unset: keep Ray's")
GLOO_SOCKET_IFNAME: EnvVar[str] = EnvVar(
    "GLOO_SOCKET_IFNAME", str, "",
    "network interfaces (comma separated) of Gloo's sockets, TP and KV pair groups alike; "
    "unset: the local address that reaches the group's rendezvous address (a gloo TP group "
    "sets it to that interface, a rank whose stores bind 127.0.0.1 to 'lo')")
ORCH_ALLOW_LONG_MAX_MODEL_LEN: EnvVar[bool] = EnvVar(
    "ORCH_ALLOW_LONG_MAX_MODEL_LEN", _flag, False,
    "1: config load accepts a model.max_model_len above the model's max_position_embeddings "
    "(vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN; positions past it were never trained); not for "
    "DeepSeek-V4, whose runner refuses any step past it")
ORCH_TOKEN: EnvVar[str] = EnvVar(
    "ORCH_TOKEN", str, "",
    "bearer token `orch generate` / `orch status` send when --token-file is not given "
    "(a router with router.auth needs one)")

ORCH_LOG_LEVEL: EnvVar[str] = EnvVar(
    "ORCH_LOG_LEVEL", _log_level, "INFO",
    "log level of the `orch` commands: DEBUG adds the full detail (tracebacks) of each fault "
    "that is otherwise logged as one line")
RAY_COLOR_PREFIX: EnvVar[str] = EnvVar(
    "RAY_COLOR_PREFIX", str, "",
    "'0': Ray prints its (raylet) and worker line prefixes without ANSI colour codes (read by "
    "Ray); `orch up` sets it to '0' when stdout is not a terminal unless it is already set")
RAY_ADDRESS: EnvVar[str] = EnvVar(
    "RAY_ADDRESS", str, "",
    "read by Ray itself: the cluster a bare ray.init() joins; orch joins only "
    "cluster.address and removes this variable before starting its embedded private Ray")

RAY_AUTH_MODE: EnvVar[str] = EnvVar(
    "RAY_AUTH_MODE", str, "",
    "read by Ray itself: unset or 'token', a new local Ray cluster (orch's embedded one) "
    "requires the token in ~/.ray/auth_token (made on first use); 'disabled' turns that off")

GRPC_VERBOSITY: EnvVar[str] = EnvVar(
    "GRPC_VERBOSITY", str, "",
    "read by gRPC's C core when it starts: the least severe of its own lines that it prints; "
    "the `orch` commands set it to ERROR unless it is set already (else every failed TLS "
    "handshake, e.g. a plaintext client, prints a line: anyone who reaches the port could "
    "fill the log)")

ALL: tuple[EnvVar, ...] = (ORCH_CACHE_DIR, ORCH_DEVICE, ORCH_TORCH_THREADS, ORCH_RANK_NICE,
                           GLOO_SOCKET_IFNAME, ORCH_ALLOW_LONG_MAX_MODEL_LEN,
                           ORCH_TOKEN, ORCH_LOG_LEVEL, RAY_COLOR_PREFIX, RAY_ADDRESS,
                           RAY_AUTH_MODE, GRPC_VERBOSITY)
