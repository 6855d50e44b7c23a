"""`orch generate` / `orch status` / `orch bench` / `orch model` against a fake-leader router."""

from __future__ import annotations

import pytest

from orchestrator.cli import main
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import TOKENIZER, Harness


@pytest.fixture(scope="module")
def harness():
    h = Harness()
    yield h
    h.close()


def test_generate_streams_text_and_stats(harness, capsys):
    assert main(["generate", "Grüße", "--address", harness.address, "--max-tokens", "5",
                 "--ignore-eos"]) == 0
    captured = capsys.readouterr()
    want = expected_tokens(tuple(TOKENIZER.encode("Grüße")), 5)
    assert captured.out == TOKENIZER.decode(want) + "\n"
    assert "[length] prompt" in captured.err and "completion 5 tok" in captured.err


def test_generate_token_ids(harness, capsys):
    assert main(["generate", "5,6,7", "--token-ids", "--address", harness.address,
                 "--max-tokens", "3"]) == 0
    assert f"token ids: {expected_tokens((5, 6, 7), 3)}" in capsys.readouterr().out


def test_generate_bad_request_exits_1_with_the_reason(harness, capsys):
    assert main(["generate", "x", "--address", harness.address, "--max-tokens", "300"]) == 1
    assert "INVALID_ARGUMENT: prompt has 1 tokens + max_tokens 300 > max_model_len 256" in \
        capsys.readouterr().err


def test_status_table(harness, capsys):
    assert main(["status", "--address", harness.address]) == 0
    out = capsys.readouterr().out
    assert "model fake; 0 request(s) in flight" in out
    assert "prefill-0" in out and "decode-0" in out and "rank 0: node node-a device cpu" in out


def test_bench_and_init_tiny_are_lazy(tmp_path, capsys):
    try:
        import orchestrator.bench.cli  # noqa: F401
    except ImportError:
        assert main(["bench"]) == 1
        assert "orch bench: the benchmark package is not installed" in capsys.readouterr().err
    try:
        import orchestrator.tiny_model  # noqa: F401
    except ImportError:
        assert main(["model", "init-tiny", str(tmp_path / "t")]) == 1
        assert "the engine is not installed" in capsys.readouterr().err
    else:
        assert main(["model", "init-tiny", str(tmp_path / "t")]) == 0
        assert (tmp_path / "t" / "config.json").is_file()
