"""The HTTP API's edge: HTTPS with router.tls, a taken router.http_port refused before the
bring-up and when binding, router.http_port distinct from the other ports."""

from __future__ import annotations

import socket
import ssl

import httpx
import openai
import pytest

from orchestrator.config.schema import OrchConfig
from orchestrator.config.load import load_config
from orchestrator.config.sections import TLSSection
from orchestrator.config.errors import ConfigError
from orchestrator.api.http.server import HttpServer
from orchestrator.api.server import PortInUseError
from orchestrator.up import check_ports_free
from tests.orchestrator.harness import MODEL
from tests.orchestrator.test_auth import make_cert
from tests.orchestrator.test_http_api import HttpHarness


def test_https_with_router_tls(tmp_path):
    cert, key = make_cert(tmp_path, "router")
    h = HttpHarness(tls=TLSSection(cert_file=cert, key_file=key))
    try:
        assert h.url.startswith("https://")
        client = openai.OpenAI(base_url=h.url, api_key="none", max_retries=0, timeout=10,
                               http_client=httpx.Client(
                                   verify=ssl.create_default_context(cafile=cert)))
        out = client.completions.create(model=MODEL.name, prompt="hi", max_tokens=3)
        assert out.usage.completion_tokens == 3
        with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS port
            httpx.get(h.url.replace("https", "http")[:-3] + "/health", timeout=5)
    finally:
        h.close()


def test_taken_http_port_is_refused_naming_the_key():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = OrchConfig.model_validate({"router": {"port": 0, "http_port": port}})
        with pytest.raises(PortInUseError, match="router.http_port"):
            check_ports_free(cfg)
        h = HttpHarness()
        try:
            server = HttpServer(h.http.config.app, "127.0.0.1", port)
            with pytest.raises(PortInUseError, match="pick another router.http_port"):
                h.run(server.start())
        finally:
            h.close()


def test_http_port_must_differ_from_the_other_ports(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("router: {port: 9000, metrics_port: 9001, http_port: 9001}\n")
    with pytest.raises(ConfigError, match="router.http_port"):
        load_config(path)


def test_up_http_port_flag(tmp_path, capsys):
    from orchestrator.cli import main

    config = tmp_path / "c.yaml"
    config.write_text("router: {port: 50051}\ncluster: {device: cpu}\n")
    assert main(["up", "--dry-run", str(config), "--http-port", "50051"]) == 2
    assert "router.http_port (50051) equals router.port" in capsys.readouterr().err
