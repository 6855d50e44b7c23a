"""Free TCP ports for tests, taken outside the kernel's ephemeral range.

A port the kernel handed out for ``bind(0)`` and that the test then released is back in the
ephemeral pool: while `orch up` brings up Ray, gloo and the step channels (hundreds of
outgoing connections and ``bind(0)`` listeners), one of them can take it before the router or
the metrics server binds it (seen in CI: ``OSError: [Errno 98] Address already in use`` on
``router.metrics_port``). Ports here come from below the ephemeral range and above Ray's
default worker ports (10002-19999), so nothing started by the run is handed one of them.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOW = 20000
_FALLBACK_EPHEMERAL_LOW = 32768


def _ephemeral_low() -> int:
    """Start of the kernel's ephemeral port range (Linux ``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A TCP port on ``host`` that is free now and outside the ephemeral range.

    Raises:
        RuntimeError: no free port among ``tries`` random picks.
    """
    high = _ephemeral_low() - 1
    if high <= _LOW:
        raise RuntimeError(f"the ephemeral range starts at {high + 1}: no room below it "
                           f"above {_LOW}")
    for _ in range(tries):
        port = random.randint(_LOW, high)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_LOW}-{high} on {host} after {tries} tries")
