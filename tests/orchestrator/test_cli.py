"""`orch generate` / `orch status` / `orch bench` / `orch model` against a fake-leader router."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.cli import main
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import TOKENIZER, Harness

ROOT = Path(__file__).resolve().parents[2]


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


def test_generate_stop_strings_cut_the_text(harness, capsys):
    full = TOKENIZER.decode(expected_tokens(tuple(TOKENIZER.encode("Grüße")), 20))
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert main(["generate", "Grüße", "--address", harness.address, "--max-tokens", "20",
                 "--ignore-eos", "--stop", "never-there", "--stop", stop]) == 0
    captured = capsys.readouterr()
    assert captured.out == full[:full.find(stop)] + "\n"
    assert "[stop] prompt" in captured.err


def test_generate_token_ids(harness, capsys):
    assert main(["generate", "5,6,7", "--token-ids", "--address", harness.address,
                 "--max-tokens", "3"]) == 0
    assert f"token ids: {expected_tokens((5, 6, 7), 3)}" in capsys.readouterr().out


def test_generate_stats_follow_the_output_on_their_own_line(harness):
    """stdout and stderr into one pipe (``2>&1 | ...``): the token ids line ends before the
    stats line starts (stdout, block-buffered in a pipe, was written after stderr's line)."""
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "generate", "5,6,7", "--token-ids",
         "--address", harness.address, "--max-tokens", "3", "--ignore-eos"],
        cwd=ROOT, timeout=60,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
             "PYTHONPATH": str(ROOT)})  # NOTE: a user's shell: stdout block-buffered in a pipe
    assert done.returncode == 0, done.stdout
    assert f"token ids: {expected_tokens((5, 6, 7), 3)}\n[length] prompt 3 tok" in done.stdout


def test_generate_bad_request_exits_1_with_the_reason(harness, capsys):
    assert main(["generate", "x", "--address", harness.address, "--max-tokens", "300"]) == 1
    assert "INVALID_ARGUMENT: prompt has 1 tokens + max_tokens 300 > max_model_len 256" in \
        capsys.readouterr().err


def test_status_table(harness, capsys):
    assert main(["status", "--address", harness.address]) == 0
    out = capsys.readouterr().out
    assert "model fake; 0 request(s) in flight" in out
    assert "prefill-0" in out and "decode-0" in out and "rank 0: node node-a device cpu pid 4242" in out


# NOTE: a fresh interpreter where torch, ray and the bench package cannot be imported (a
# meta-path finder refuses them and records every attempt): an `orch` install without the
# engine or the benchmark still parses every command, and those two commands say what is
# missing instead of a traceback.
WITHOUT_ENGINE_AND_BENCH = textwrap.dedent("""
    import importlib.abc
    import sys

    tried = []

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "ray") or name.startswith("orchestrator.bench"):
                tried.append(name)
                raise ImportError(f"{name} is blocked by this test")
            return None

    sys.meta_path.insert(0, Blocker())
    from orchestrator.cli import build_parser, main

    build_parser()
    assert tried == ["orchestrator.bench"], tried  # no torch or ray to build the parser
    assert main(["bench", "--num-requests", "3"]) == 1
    assert main(["model", "init-tiny", sys.argv[1]]) == 1
    print("exit codes ok")
""")


def test_bench_and_init_tiny_without_their_packages_say_what_is_missing(tmp_path):
    out = tmp_path / "t"
    proc = subprocess.run([sys.executable, "-c", WITHOUT_ENGINE_AND_BENCH, str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "exit codes ok" in proc.stdout, proc.stderr
    assert "orch bench: the benchmark package is not installed" in proc.stderr
    assert "install the full orch package (orchestrator/bench)" in proc.stderr
    assert "orch model init-tiny: the engine is not installed" in proc.stderr
    assert not out.exists()


def test_bench_and_init_tiny_when_installed(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--help"])
    assert exited.value.code == 0 and "--workload" in capsys.readouterr().out
    assert main(["model", "init-tiny", str(tmp_path / "t")]) == 0
    assert (tmp_path / "t" / "config.json").is_file()
    # NOTE: never over a folder with files (a real checkpoint would be overwritten in part)
    before = (tmp_path / "t" / "config.json").stat().st_mtime_ns
    assert main(["model", "init-tiny", "--arch", "deepseek_v32", str(tmp_path / "t")]) == 2
    assert main(["model", "init-tiny", str(tmp_path / "t" / "config.json")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 't'} is not empty: init-tiny writes" in err and "is a file" in err
    assert (tmp_path / "t" / "config.json").stat().st_mtime_ns == before


def test_generate_error_after_a_token_is_on_its_own_line(harness, capsys):
    harness.fakes["decode-0"].error_after_admit = "decode-0 rank 1 is gone"
    try:
        assert main(["generate", "5,6,7", "--token-ids", "--address", harness.address,
                     "--max-tokens", "4"]) == 1
    finally:
        harness.fakes["decode-0"].error_after_admit = None
    captured = capsys.readouterr()
    first = TOKENIZER.decode(expected_tokens((5, 6, 7), 1))
    assert captured.out == first + "\n"  # the token that streamed, its line ended
    assert captured.err.startswith("orch generate: ")
    assert "decode-0 rank 1 is gone" in captured.err and captured.err.count("\n") == 1


def test_up_flags_override_the_router_section(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("router: {port: 50051}\ncluster: {device: cpu}\n")
    assert main(["up", "--dry-run", str(config), "--port", "9123", "--host", "0.0.0.0",
                 "--metrics-port", "9124", "--metrics-host", "10.1.2.3"]) == 0
    out = capsys.readouterr().out
    assert "router: 0.0.0.0:9123 (no TLS, no token), policy" in out
    assert "metrics on 10.1.2.3:9124/metrics" in out
    assert main(["up", "--dry-run", str(config), "--port", "70000"]) == 2
    assert "router.port: must be <= 65535, got 70000" in capsys.readouterr().err
    assert main(["up", "--dry-run", str(config), "--metrics-port", "50051"]) == 2
    assert "router.metrics_port (50051) equals router.port" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["a3_p2x16_d8x4.yaml", "a3_v32_p2x16_d8x4.yaml",
                                  "a3_glm5_p2x16_d8x4.yaml", "gpu_p4x8_d8x4.yaml"])
def test_shipped_remote_configs_require_a_token(name, capsys):
    """A config that listens on every interface asks for a token (README, Security)."""
    config = Path(__file__).resolve().parents[2] / "configs" / name
    assert main(["up", "--dry-run", str(config)]) == 0
    (router,) = [line for line in capsys.readouterr().out.splitlines()
                 if line.startswith("router: ")]
    assert router.startswith("router: 0.0.0.0:50051 (no TLS, token from $ORCH_TOKEN)")


@pytest.mark.parametrize("after_s", [0.3, 1.0])
def test_ctrl_c_in_the_first_second_of_orch_up_exits_130_without_a_traceback(after_s, tmp_path):
    """SIGINT while `orch up` still imports and loads its config (before its own handlers are
    in place): one line, exit 130, no traceback."""
    import os
    import signal
    import time

    config = tmp_path / "up.yaml"
    config.write_text("cluster: {device: cpu}\nrouter: {port: 0}\n")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "up", str(config),
                             "--dry-run"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, ORCH_CACHE_DIR=str(tmp_path)))
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip(f"orch up --dry-run finished within {after_s} s: nothing to interrupt")
    assert "Traceback" not in err, err
    # NOTE: 130, or ended by the SIGINT itself (-2 here; the shell reports 130 for both)
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, err)
    assert "interrupted" in err


def test_status_and_generate_take_the_port_orch_up_was_given(harness, capsys):
    """`orch up --port N` pairs with `orch status --port N` (or --address 127.0.0.1:N)."""
    port = harness.address.rsplit(":", 1)[1]
    assert main(["status", "--port", port]) == 0
    assert main(["generate", "hi", "--port", port, "--max-tokens", "2"]) == 0
    with pytest.raises(SystemExit) as info:
        main(["status", "--port", port, "--address", harness.address])
    assert info.value.code == 2
    assert "not both" in capsys.readouterr().err


def test_output_into_a_closed_pipe_exits_quietly():
    """`orch up --dry-run ... | head -3` (or `orch status | head`): once the reader has gone,
    the command stops with the shell's SIGPIPE status (141), no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "up", "--dry-run",
                             str(ROOT / "configs" / "1p1d.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # NOTE: the reader is gone before the command writes a byte
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
