"""orch's log set-up: level from ORCH_LOG_LEVEL, no ANSI colour codes off a terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import logging
from orchestrator.logs import setup_logging

setup_logging()
log = logging.getLogger("orchestrator.test")
log.warning("leader drain did not complete: \\x1b[36mray::PrefillRank.drain()\\x1b[39m failed")
log.debug("the detail")
logging.getLogger("httpx").info("HTTP Request: POST http://h/v1/completions 200")
"""


def _run(level: str) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, ORCH_LOG_LEVEL=level))
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_log_lines_off_a_terminal_have_no_colour_codes():
    err = _run("")
    assert "WARNING orchestrator.test: leader drain did not complete: " \
           "ray::PrefillRank.drain() failed\n" in err
    assert "\x1b" not in err and "the detail" not in err
    assert "HTTP Request" not in err  # one line per request of `orch bench --backend openai`


def test_log_level_from_the_environment():
    assert "DEBUG orchestrator.test: the detail" in _run("debug")
    err = _run("loud")
    assert "orch: environment variable ORCH_LOG_LEVEL='loud' is invalid: must be one of " \
           "DEBUG, INFO, WARNING, ERROR" in err and "the detail" not in err


def test_repeated_warning_is_shown_once_per_window():
    import logging

    from orchestrator.logs import RepeatFilter

    now = [0.0]
    repeat = RepeatFilter(window_s=60.0, clock=lambda: now[0])

    def shown(text: str, level: int = logging.WARNING) -> str | None:
        record = logging.LogRecord("orchestrator.router.leader", level, __file__, 1, "polling %s: %s",
                                   ("decode-0", text), None)
        return record.getMessage() if repeat.filter(record) else None

    assert shown("gone") == "polling decode-0: gone"
    for step in range(1, 120):  # every 0.5 s for a minute: dropped
        now[0] = step * 0.5
        assert shown("gone") is None
    assert shown("other error") == "polling decode-0: other error"
    assert shown("gone", logging.INFO) == "polling decode-0: gone"  # only warnings repeat-drop
    now[0] = 60.0
    assert shown("gone") == ("polling decode-0: gone (and 119 identical line(s) in the 60 s "
                             "before)")
    assert shown("gone") is None


def test_health_transitions_are_never_folded():
    """The same instance killed twice a few seconds apart: both faults are in the log."""
    import logging

    from orchestrator.logs import RepeatFilter

    repeat = RepeatFilter(window_s=60.0, clock=lambda: 0.0)
    record = logging.LogRecord("orchestrator.deploy.health", logging.WARNING, __file__, 1,
                               "%s is unhealthy: %s", ("prefill-0", "rank 0 is gone"), None)
    assert repeat.filter(record) and repeat.filter(record)


TLS_SCRIPT = """
from orchestrator.logs import setup_logging

setup_logging()  # NOTE: before gRPC is imported, as in `orch`
import grpc
from concurrent import futures

server = grpc.server(futures.ThreadPoolExecutor(1))
creds = grpc.ssl_server_credentials([(open({key!r}, "rb").read(), open({cert!r}, "rb").read())])
port = server.add_secure_port("127.0.0.1:0", creds)
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{{port}}")  # a plaintext client: handshakes fail
try:
    grpc.channel_ready_future(channel).result(timeout=2)
except grpc.FutureTimeoutError:
    pass
server.stop(0)
"""


def test_failed_tls_handshakes_do_not_write_to_the_log(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"],
                   check=True, capture_output=True, timeout=60)
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    done = subprocess.run([sys.executable, "-c", TLS_SCRIPT.format(key=str(key), cert=str(cert))],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "Handshake failed" not in done.stderr, done.stderr
