"""Prefill and decode on two hosts: two network namespaces joined by a veth pair, one Ray node
each, set up by running README's multi-node recipe as written (token authentication on), the
hostname resolving to a loopback address in both as on a stock host.

`orch up` runs on the head (host a, prefill pinned there), decode tp 1 and tp 2 on host b:
greedy outputs equal the colocated baseline's and the KV bytes cross the link (host a's veth
sent at least the KV bytes the prefill side reports). SIGINT stops orch within a bound.
Without the recipe's token setting, `orch up` is refused and says what to do in one line.
Skipped, saying why, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import REPO
from tests.e2e.two_hosts import Recipe, TwoHosts, readme_recipe, unavailable_reason

NUM_REQUESTS = 4
ROUTER = "127.0.0.1:50051"  # the router inside host a's namespace (its own port space)
NODE_START_S = 90.0
READY_S = 240.0
STOP_WITHIN_S = 30.0


def _env() -> dict[str, str]:
    """The test's environment without any Ray setting (the recipe sets what it needs) and
    with this checkout's venv first on PATH (``ray``, ``orch``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _script(lines: list[str], head_ip: str, ray_start_args: str) -> str:
    """Recipe lines as one bash script; ``ray start`` lines get ``ray_start_args`` (--block:
    the test owns the node's processes)."""
    out = [line.replace("HEAD_IP", head_ip) + (ray_start_args if line.startswith("ray start")
                                                else "") for line in lines]
    return "set -e\n" + "\n".join(out)


def _wait_for_line(log: Path, proc: subprocess.Popen, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} in {log} within {timeout_s:g} s "
                                 f"(exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(hosts, recipe, env): both Ray nodes up, started by the README's recipe."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"cannot simulate two hosts: {reason}")
    logs = tmp_path_factory.mktemp("two_hosts")
    recipe, env, hosts = readme_recipe(REPO / "README.md"), _env(), TwoHosts()
    try:
        hosts.start()
        # NOTE: --temp-dir keeps this cluster's files (and its ray_current_cluster, which a
        # bare ray.init() on this machine would join) out of /tmp/ray.
        head = hosts.spawn(hosts.a, _script(recipe.common + recipe.head, hosts.a.address,
                                            f" --block --temp-dir {hosts.ray_temp_dir}"),
                           logs / "head.log", env)
        _wait_for_line(logs / "head.log", head, "Ray runtime started", NODE_START_S)
        other = hosts.spawn(hosts.b, _script(recipe.common + recipe.other, hosts.a.address,
                                             " --block"), logs / "other.log", env)
        _wait_for_line(logs / "other.log", other, "Ray runtime started", NODE_START_S)
        yield hosts, recipe, env
    finally:
        hosts.close()


def _config(tmp: Path, head_ip: str, decode_tp: int) -> Path:
    """configs/1p1d.yaml on the recipe's cluster, roles pinned."""
    data = yaml.safe_load((REPO / "configs" / "1p1d.yaml").read_text())
    data["cluster"]["address"] = f"{head_ip}:6379"
    data["prefill"]["ray_resources"] = {"prefill_node": 0.01}
    data["decode"]["ray_resources"] = {"decode_node": 0.01}
    data["decode"]["tp"] = decode_tp
    # NOTE: the two "hosts" are network namespaces of one kernel (one boot id, one /dev/shm),
    # which the same-node KV path would take for one node: the KV must cross the link here
    data["kv_transfer"]["same_node"] = "off"
    path = tmp / "my_cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _client(hosts: TwoHosts, env: dict, args: list[str], timeout_s: float,
            stdin: str = "") -> dict:
    argv = [sys.executable, "-m", "tests.e2e.netns_client", *args]
    return json.loads(hosts.run(hosts.a, argv, env, timeout_s, stdin))


def _start_orch(hosts: TwoHosts, recipe: Recipe, env: dict, config: Path,
                log: Path) -> tuple[subprocess.Popen, dict[str, list[str]]]:
    """The recipe's `orch up` line on the head, with ``config``; waits until SERVING.
    (process, role -> node ids of its ranks)."""
    lines = [line.replace("my_cluster.yaml", str(config)) for line in recipe.orch]
    orch = hosts.spawn(hosts.a, _script(recipe.common, hosts.a.address, "") + "\nexec "
                       + "\n".join(lines), log, env)
    try:
        ready = _client(hosts, env, ["ready", ROUTER, str(READY_S)], READY_S + 30)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        _stop(orch, log, STOP_WITHIN_S)
        raise AssertionError(f"{exc}\norch log:\n{log.read_text()[-4000:]}") from None
    return orch, ready["nodes"]


def _stop(orch: subprocess.Popen, log: Path, within_s: float) -> None:
    """SIGINT orch; fails unless it exits 0 within ``within_s``."""
    orch.send_signal(signal.SIGINT)
    try:
        code = orch.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"orch up still running {within_s:g} s after SIGINT:\n"
                             f"{log.read_text()[-3000:]}")  # NOTE: keeps the test's own error
    assert code == 0, f"orch up exited {code}:\n{log.read_text()[-3000:]}"


# NOTE: decode tp 2 only (P1 -> D2: both decode ranks receive over the link, and decode's TP
# all-reduce runs on its host); tp 1 added 30 s of CI for a subset of the same paths
@pytest.mark.parametrize("decode_tp", [2])
def test_prefill_and_decode_on_two_hosts(cluster, decode_tp, tmp_path, prompts,
                                         colocated_outputs):
    hosts, recipe, env = cluster
    log = tmp_path / "orch.log"
    config = _config(tmp_path, hosts.a.address, decode_tp)
    orch, nodes = _start_orch(hosts, recipe, env, config, log)
    try:
        assert len(set(nodes["prefill"])) == 1 and len(set(nodes["decode"])) == 1, nodes
        assert set(nodes["prefill"]) != set(nodes["decode"]), nodes
        _, tx0 = hosts.a.link_bytes()
        out = _client(hosts, env, ["generate", ROUTER, str(MAX_TOKENS)], 200,
                      json.dumps(prompts[:NUM_REQUESTS]))
        _, tx1 = hosts.a.link_bytes()
        assert out["outputs"] == colocated_outputs[:NUM_REQUESTS], log.read_text()[-3000:]
        assert out["kv_bytes_sent"] > 0
        assert tx1 - tx0 >= out["kv_bytes_sent"], (tx1 - tx0, out["kv_bytes_sent"])
    finally:
        _stop(orch, log, STOP_WITHIN_S)


def test_orch_up_without_the_token_says_what_to_do(cluster, tmp_path):
    hosts, _, env = cluster
    config = _config(tmp_path, hosts.a.address, decode_tp=1)
    argv = [sys.executable, "-m", "orchestrator.cli", "up", str(config)]
    out = subprocess.run(hosts.a.argv(argv), capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    error = out.stderr.strip().splitlines()[-1]
    assert "InvalidAuthToken" in error and "RAY_AUTH_MODE=token" in error, out.stderr
