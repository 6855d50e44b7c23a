"""A peer that sends a hello one byte at a time: tests that a server bounds the whole hello,
not each ``recv`` of it."""

from __future__ import annotations

import select
import socket
import time


def seconds_until_closed(host: str, port: int, data: bytes, every_s: float) -> float | None:
    """Connect to (``host``, ``port``) and send ``data`` one byte every ``every_s`` seconds;
    the seconds from the connect until the server closed the connection, or None when it was
    still open after the last byte (and ``every_s`` more)."""
    with socket.create_connection((host, port), timeout=5.0) as sock:
        start = time.monotonic()
        for byte in data:
            try:
                sock.sendall(bytes([byte]))
                readable, _, _ = select.select([sock], [], [], every_s)
                if readable and sock.recv(1) == b"":
                    return time.monotonic() - start
            except OSError:  # NOTE: reset by the server: closed too
                return time.monotonic() - start
    return None
