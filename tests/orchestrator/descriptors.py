"""A socket connected to a listener while this process is out of descriptors (EMFILE), so
that the listener's ``accept()`` fails: tests that a server outlives a descriptor shortage."""

from __future__ import annotations

import errno
import resource
import socket
import time


def connect_during_shortage(host: str, port: int, hold_s: float = 0.5) -> socket.socket:
    """A socket connected to (``host``, ``port``) while every descriptor of the process is
    taken for ``hold_s`` seconds (the server's ``accept()`` then fails with EMFILE, the
    connection stays queued); the shortage is over when it returns. The caller closes it.

    Raises:
        AssertionError: the descriptors could not be used up (the limit did not apply).
    """
    queued = socket.socket()  # NOTE: made before the shortage; connect needs no descriptor
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, queued.fileno() + 64), hard))
        try:
            while True:
                held.append(socket.socket())
        except OSError as exc:
            assert exc.errno == errno.EMFILE, exc
        queued.connect((host, port))
        time.sleep(hold_s)
    finally:
        for sock in held:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return queued
