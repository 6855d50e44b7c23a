"""TLS and the bearer token (issue 10, Security): a client without the token, or with a wrong
one, gets UNAUTHENTICATED; with it the output is as usual; health stays open; a plaintext
client against a TLS router fails at once, and the CLI says what to pass."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from orchestrator import cli
from orchestrator.api.client import OrchClient
from orchestrator.config.sections import AuthSection, RouterSection, TLSSection
from orchestrator.config.errors import ConfigError
from orchestrator.api.security import load_security
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import Harness


def make_cert(folder: Path, name: str) -> tuple[str, str]:
    """A self-signed EC certificate for localhost / 127.0.0.1: (cert path, key path)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: cannot make a test certificate")
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A TLS + token router over fake leaders: (harness, CA file, token, token file)."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = make_cert(folder, "router")
    token = secrets.token_hex(16)
    token_file = folder / "token"
    token_file.write_text(token + "\n")
    router = RouterSection(tls=TLSSection(cert_file=cert, key_file=key),
                           auth=AuthSection(token_file=str(token_file)))
    h = Harness(security=load_security(router))
    yield h, cert, token, str(token_file)
    h.close()


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789", ""])
def test_missing_or_wrong_token_is_unauthenticated_on_every_method(secured, token):
    h, ca, _, _ = secured
    with OrchClient(h.address, tls_ca=ca, token=token) as client:
        assert _code(lambda: list(client.generate(token_ids=[5], max_tokens=2))) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: client.status()) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: client.abort("r1")) == grpc.StatusCode.UNAUTHENTICATED
    assert h.call_in_loop(lambda: h.fakes["prefill-0"].calls) == []


def test_with_the_token_output_is_as_usual_and_health_is_open(secured):
    h, ca, token, _ = secured
    with OrchClient(h.address, tls_ca=ca, token=token) as client:
        _, ids, stats = client.generate_text(token_ids=[5, 6], max_tokens=4, ignore_eos=True)
        instances, _, _ = client.status()
    assert ids == expected_tokens((5, 6), 4) and stats.completion_tokens == 4
    assert {s.name for s in instances} == {"prefill-0", "decode-0"}
    with OrchClient(h.address, tls_ca=ca) as anonymous:
        anonymous.wait_ready(timeout_s=10)  # health needs no token


def test_plaintext_client_against_tls_router_fails_at_once(secured):
    h, _, token, _ = secured
    with OrchClient(h.address, token=token) as client:
        assert _code(lambda: client.status(timeout_s=10)) == grpc.StatusCode.UNAVAILABLE


def test_client_trusting_another_ca_is_refused(secured, tmp_path):
    h, _, token, _ = secured
    other, _ = make_cert(tmp_path, "other")
    with OrchClient(h.address, tls_ca=other, token=token) as client:
        assert _code(lambda: client.status(timeout_s=10)) == grpc.StatusCode.UNAVAILABLE


def test_cli_generate_and_status_with_tls_ca_and_token(secured, capsys, monkeypatch):
    h, ca, token, token_file = secured
    base = ["--address", h.address, "--tls-ca", ca]
    assert cli.main(["generate", "--token-ids", "5,6", "--max-tokens", "3", "--ignore-eos",
                     "--token-file", token_file, *base]) == 0
    assert f"token ids: {expected_tokens((5, 6), 3)}" in capsys.readouterr().out
    monkeypatch.setenv("ORCH_TOKEN", token)
    assert cli.main(["status", *base]) == 0
    assert "prefill-0" in capsys.readouterr().out
    monkeypatch.delenv("ORCH_TOKEN")
    assert cli.main(["status", *base]) == 1
    assert "UNAUTHENTICATED: no bearer token" in capsys.readouterr().err
    assert cli.main(["status", "--address", h.address, "--timeout", "10"]) == 1
    assert "needs --tls-ca FILE" in capsys.readouterr().err


def test_token_from_env_without_tls(monkeypatch):
    token = secrets.token_hex(16)
    monkeypatch.setenv("ORCH_TEST_ROUTER_TOKEN", token)
    security = load_security(RouterSection(auth=AuthSection(token_env="ORCH_TEST_ROUTER_TOKEN")))
    h = Harness(security=security)
    try:
        with OrchClient(h.address, token=token) as client:
            _, ids, _ = client.generate_text(token_ids=[7], max_tokens=2, ignore_eos=True)
        assert ids == expected_tokens((7,), 2)
        with OrchClient(h.address) as client:
            assert _code(lambda: client.status()) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        h.close()


def test_security_config_errors_name_the_key(tmp_path, monkeypatch):
    cert, key = make_cert(tmp_path, "router")
    with pytest.raises(ValueError, match="exactly one of token_file"):
        AuthSection(token_file="a", token_env="B")
    with pytest.raises(ValueError, match="exactly one of token_file"):
        AuthSection()
    cases = [
        (RouterSection(tls=TLSSection(cert_file=str(tmp_path / "nope"), key_file=key)),
         "router.tls.cert_file: cannot read"),
        (RouterSection(tls=TLSSection(cert_file=key, key_file=key)),
         "router.tls.cert_file: .* is not a PEM certificate"),
        (RouterSection(tls=TLSSection(cert_file=cert, key_file=cert)),
         "router.tls.key_file: .* is not a PEM private key"),
        (RouterSection(auth=AuthSection(token_env="ORCH_TEST_UNSET_TOKEN")),
         "router.auth.token_env: environment variable ORCH_TEST_UNSET_TOKEN is unset"),
    ]
    (tmp_path / "short").write_text("abc\n")
    cases.append((RouterSection(auth=AuthSection(token_file=str(tmp_path / "short"))),
                  "router.auth.token_file: the token must be at least 16"))
    monkeypatch.delenv("ORCH_TEST_UNSET_TOKEN", raising=False)
    for router, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_security(router)


def test_orch_up_with_an_unreadable_token_file_fails_before_bring_up(tmp_path, capsys,
                                                                     monkeypatch):
    import orchestrator.up as up

    def no_ray(cfg):
        raise AssertionError("orch up started Ray although its security config is broken")
    monkeypatch.setattr(up, "connect_ray", no_ray)
    monkeypatch.setattr(up, "ensure_checkpoint", no_ray)
    cfg = tmp_path / "up.yaml"
    cfg.write_text(f"router: {{port: 0, auth: {{token_file: {tmp_path / 'missing'}}}}}\n"
                   "cluster: {device: cpu}\n")
    assert cli.main(["up", str(cfg)]) == 2
    assert "router.auth.token_file: cannot read" in capsys.readouterr().err


def test_metrics_stay_on_loopback_when_the_router_listens_everywhere():
    from orchestrator.config.schema import OrchConfig
    from orchestrator.up import make_metrics

    cfg = OrchConfig.model_validate({"router": {"host": "0.0.0.0", "metrics_port": 0},
                                     "cluster": {"device": "cpu"}})
    metrics = make_metrics(cfg)
    try:
        assert metrics._httpd.server_address[0] == "127.0.0.1"
    finally:
        metrics.stop()


def test_async_client_with_tls_and_token(secured):
    import asyncio

    from orchestrator.api.client import AsyncOrchClient

    h, ca, token, _ = secured

    async def go():
        client = AsyncOrchClient(h.address, tls_ca=ca, token=token)
        try:
            _, ids, _ = await client.generate_text(token_ids=[9], max_tokens=2, ignore_eos=True)
            return ids, await client.abort("not-running")
        finally:
            await client.close()
    assert asyncio.run(go()) == (expected_tokens((9,), 2), False)


@pytest.mark.parametrize("presented, ok", [
    ("Bearer tok-0123456789abcdef", True), ("bearer tok-0123456789abcdef", True),
    ("BEARER  tok-0123456789abcdef ", True), ("Basic tok-0123456789abcdef", False),
    ("Bearer tok-0123456789abcdeX", False), ("tok-0123456789abcdef", False), ("", False),
    (None, False)])
def test_bearer_scheme_is_case_insensitive_and_the_token_exact(presented, ok):
    from orchestrator.api.security import bearer_matches

    assert bearer_matches(presented, "tok-0123456789abcdef") is ok


def _with_dates(cert: str, out: Path, not_before: bytes | None = None,
                not_after: bytes | None = None) -> str:
    """A copy of the PEM certificate ``cert`` whose validity reads ``not_before`` /
    ``not_after`` (UTCTime "YYMMDDHHMMSSZ"); its signature no longer matches, which the
    checks under test do not look at (clients do)."""
    import base64
    import re

    pem = Path(cert).read_text()
    body = "".join(pem.strip().splitlines()[1:-1])
    der = base64.b64decode(body)
    times = [m.start() for m in re.finditer(rb"\x17\x0d\d{12}Z", der)][:2]
    for pos, value in zip(times, (not_before, not_after)):
        if value is not None:
            der = der[:pos + 2] + value + der[pos + 15:]
    text = base64.b64encode(der).decode()
    out.write_text("-----BEGIN CERTIFICATE-----\n" + "\n".join(
        text[i:i + 64] for i in range(0, len(text), 64)) + "\n-----END CERTIFICATE-----\n")
    return str(out)


def test_a_bad_key_pair_or_certificate_is_refused_when_loaded_naming_file_and_problem(
        tmp_path):
    cert, key = make_cert(tmp_path, "router")
    _, other_key = make_cert(tmp_path, "other")
    expired = _with_dates(cert, tmp_path / "expired.crt", not_after=b"200101000000Z")
    early = _with_dates(cert, tmp_path / "early.crt", not_before=b"490101000000Z")
    stranger = tmp_path / "stranger.crt"  # a CA that issued nothing here
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "30", "-subj",
                    "/CN=stranger-ca", "-keyout", str(tmp_path / "stranger.key"), "-out",
                    str(stranger)], check=True, capture_output=True, timeout=60)
    chain = tmp_path / "chain.crt"
    chain.write_text(Path(cert).read_text() + stranger.read_text())
    cases = [
        (cert, other_key, f"router.tls.key_file: {other_key} is not the private key of the "
                          f"certificate in {cert}"),
        (expired, key, f"router.tls.cert_file: the server certificate in {expired} expired on "
                       "2020-01-01 00:00 UTC"),
        (early, key, f"router.tls.cert_file: the server certificate in {early} is not valid "
                     "before 2049-01-01 00:00 UTC"),
        (str(chain), key, f"router.tls.cert_file: certificate 2 in {chain} did not issue the "
                          "server certificate"),
    ]
    for cert_file, key_file, message in cases:
        with pytest.raises(ConfigError) as info:
            load_security(RouterSection(tls=TLSSection(cert_file=cert_file, key_file=key_file)))
        assert str(info.value).startswith(message), str(info.value)


def test_a_certificate_close_to_expiry_is_a_warning(tmp_path, caplog):
    cert, key = make_cert(tmp_path, "router")  # valid for one day
    with caplog.at_level("WARNING", logger="orchestrator.api.security"):
        load_security(RouterSection(tls=TLSSection(cert_file=cert, key_file=key)))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"router.tls.cert_file: the server certificate in {cert} expires "
                           "on ") and "renew it soon" in line


def test_orch_up_with_a_mismatched_key_fails_before_ray_starts(tmp_path, capsys, monkeypatch):
    import orchestrator.up as up

    def no_ray(cfg):
        raise AssertionError("orch up started Ray although its TLS key pair is broken")
    monkeypatch.setattr(up, "connect_ray", no_ray)
    monkeypatch.setattr(up, "ensure_checkpoint", no_ray)
    cert, _ = make_cert(tmp_path, "router")
    _, other_key = make_cert(tmp_path, "other")
    cfg = tmp_path / "up.yaml"
    cfg.write_text(f"router: {{port: 0, tls: {{cert_file: {cert}, key_file: {other_key}}}}}\n"
                   "cluster: {device: cpu}\n")
    assert cli.main(["up", str(cfg)]) == 2
    assert "is not the private key of the certificate" in capsys.readouterr().err
