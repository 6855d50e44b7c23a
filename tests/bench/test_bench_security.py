"""``orch bench`` against a TLS + token router (fake leaders, in-process): with --tls-ca and
the token the run completes; without the token it stops at once saying UNAUTHENTICATED and
what to pass, instead of timing every request out or failing each one."""

from __future__ import annotations

import time

from orchestrator.bench.cli import main
from orchestrator.config.sections import TLSSection
from tests.orchestrator.test_auth import make_cert, secured  # noqa: F401  (module fixture)
from tests.orchestrator.test_http_api import HttpHarness

_WORKLOAD = ["--workload", "synthetic", "--num-requests", "3", "--input-len", "8",
             "--output-len", "3", "--request-rate", "inf", "--no-progress",
             "--connect-timeout", "10", "--request-timeout", "10", "--token-range", "1000", "50000"]


def test_bench_with_tls_ca_and_token_file_completes(secured, capsys, monkeypatch):  # noqa: F811
    h, ca, _, token_file = secured
    monkeypatch.delenv("ORCH_TOKEN", raising=False)
    assert main(["--address", h.address, "--tls-ca", ca, "--token-file", token_file,
                 *_WORKLOAD]) == 0
    out = capsys.readouterr().out
    assert "completed" in out and "UNAUTHENTICATED" not in out


def test_bench_token_from_env(secured, capsys, monkeypatch):  # noqa: F811
    h, ca, token, _ = secured
    monkeypatch.setenv("ORCH_TOKEN", token)
    assert main(["--address", h.address, "--tls-ca", ca, *_WORKLOAD]) == 0


def test_bench_without_token_says_unauthenticated_at_once(secured, capsys,  # noqa: F811
                                                          monkeypatch):
    h, ca, _, _ = secured
    monkeypatch.delenv("ORCH_TOKEN", raising=False)
    calls_before = len(h.call_in_loop(lambda: h.fakes["prefill-0"].calls))
    start = time.monotonic()
    assert main(["--address", h.address, "--tls-ca", ca, *_WORKLOAD]) == 1
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and "--token-file" in err
    assert time.monotonic() - start < 5  # one refused call, not a request timeout
    assert len(h.call_in_loop(lambda: h.fakes["prefill-0"].calls)) == calls_before


def test_bench_without_tls_ca_against_tls_router_names_the_option(secured, capsys):  # noqa: F811
    h, _, _, token_file = secured
    assert main(["--address", h.address, "--token-file", token_file, *_WORKLOAD,
                 "--connect-timeout", "1"]) == 1
    assert "needs --tls-ca FILE" in capsys.readouterr().err


def test_bench_openai_backend_over_https_with_token(secured, tmp_path, capsys,  # noqa: F811
                                                    monkeypatch):
    _, _, token, token_file = secured
    monkeypatch.delenv("ORCH_TOKEN", raising=False)
    cert, key = make_cert(tmp_path, "http")
    h = HttpHarness(token=token, tls=TLSSection(cert_file=cert, key_file=key))
    try:
        base = ["--backend", "openai", "--base-url", h.url, "--tls-ca", cert, *_WORKLOAD]
        assert h.url.startswith("https://")
        assert main([*base, "--token-file", token_file]) == 0
        assert main([*base, "--api-key", token]) == 0
        capsys.readouterr()
        assert main(base) == 1
        assert "401 UNAUTHENTICATED" in capsys.readouterr().err
    finally:
        h.close()
