"""Runs `orch up` as a user would (a subprocess), on a copy of a config with test ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.api.rpc import orch_pb2, orch_pb2_grpc
from tests.leaks import busy_instances
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SHAREGPT = "sharegpt_v3_filtered_500.json"  # in ../shared/data (the `shared_data` fixture)


def sharegpt_prompts(path: Path, n: int, max_chars: int = 600) -> list[str]:
    """First ``n`` human turns of the ShareGPT file at ``path``, cut to ``max_chars`` characters.

    Raises:
        RuntimeError: the file has fewer than ``n`` usable prompts.
    """
    data = json.loads(path.read_text())
    out = []
    for item in data:
        turns = [t["value"] for t in item["conversations"] if t["from"] == "human"]
        if turns and turns[0].strip():
            out.append(turns[0][:max_chars])
        if len(out) == n:
            return out
    raise RuntimeError(f"{path} has fewer than {n} usable prompts")


class OrchProcess:
    """`orch up CONFIG` in a subprocess with router/metrics ports replaced by free ones.

    Args:
        config: path of the config to copy.
        tmp: folder for the copy and the log.
        overrides: dotted key -> value applied to the copy (e.g. {"cluster.address": ...}).
        code: the checkout whose code runs (its router and, through Ray's driver path, its
            ranks); default this one (A/B benchmarks run another beside it).
    """

    def __init__(self, config: Path, tmp: Path, overrides: dict | None = None,
                 code: Path = REPO) -> None:
        self.code = Path(code)
        data = yaml.safe_load(Path(config).read_text())
        self.port = free_port()
        data.setdefault("router", {})["port"] = self.port
        self.metrics_port = free_port() if data["router"].get("metrics_port") else None
        if self.metrics_port:
            data["router"]["metrics_port"] = self.metrics_port
        for key, value in (overrides or {}).items():
            node = data
            *path, last = key.split(".")
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
        self.config = tmp / Path(config).name
        self.config.write_text(yaml.safe_dump(data))
        self.log = tmp / f"{Path(config).stem}.log"
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "OrchProcess":
        # NOTE: Ray puts the driver's working directory first on its workers' sys.path
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(self.code))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "up", str(self.config)],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=self.code,
            start_new_session=True)
        self.wait_ready(timeout_s=240)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"orch up exited with {self.proc.returncode}:\n"
                                       f"{self.log.read_text()[-4000:]}")
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"orch up not SERVING within {timeout_s} s:\n"
                           f"{self.log.read_text()[-4000:]}")

    def stop(self, timeout_s: float = 90) -> int:
        """SIGINT (graceful drain) and wait; kills the group if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- client helpers ----------------------------------------------------------------
    def generate(self, text: str | None = None, token_ids=None, timeout_s: float = 180,
                 started: threading.Event | None = None,
                 **sampling) -> tuple[list[int], list, grpc.RpcError | None]:
        """One streamed request; returns (token ids, responses, the RpcError or None).

        ``started`` is set once the first response arrived (the request is in flight).
        """
        req = orch_pb2.GenerateRequest(sampling=orch_pb2.SamplingParams(**sampling))
        if text is not None:
            req.text = text
        else:
            req.token_ids.ids.extend(token_ids)
        with grpc.insecure_channel(self.address) as channel:
            stub = orch_pb2_grpc.OrchStub(channel)
            responses = []
            try:
                for resp in stub.Generate(req, timeout=timeout_s):
                    responses.append(resp)
                    if started is not None:
                        started.set()
            except grpc.RpcError as err:
                return [t for r in responses for t in r.token_ids], responses, err
        return [t for r in responses for t in r.token_ids], responses, None

    def generate_many(self, prompts: list[str], **sampling) -> list[list[int]]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: self.generate(p, **sampling), prompts))
        errors = [(err.code(), err.details()) for _, _, err in results if err is not None]
        assert not errors, f"requests failed: {errors}\n{self.log.read_text()[-3000:]}"
        return [tokens for tokens, _, _ in results]

    def metrics(self) -> dict[str, float]:
        """Scrape /metrics: sample name with labels -> value."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=10) as resp:
            text = resp.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    def status(self) -> orch_pb2.GetStatusResponse:
        with grpc.insecure_channel(self.address) as channel:
            return orch_pb2_grpc.OrchStub(channel).GetStatus(orch_pb2.GetStatusRequest(),
                                                             timeout=30)

    def rank_pids(self, instance: str) -> list[int]:
        """Process ids of ``instance``'s ranks in rank order (the leader first), as its status
        reports them; empty when the instance did not answer (it is unhealthy).

        Raises:
            KeyError: no instance of that name.
        """
        for inst in self.status().instances:
            if inst.name == instance:
                return [r.pid for r in inst.ranks]
        raise KeyError(f"no instance {instance!r}")


def descendants(root_pid: int) -> dict[int, str]:
    """Every process under ``root_pid`` (read from /proc): pid -> its title (argv[0]).

    Ray names a rank actor's process ``ray::<Class>`` (``ray::<Class>.<method>`` while a call
    runs), so ranks are found by title among the processes a test started.
    """
    parents: dict[int, int] = {}
    titles: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # the process ended meanwhile
            continue
        pid = int(entry.name)
        parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after "(comm)"
        titles[pid] = argv[0].decode(errors="replace")
    found, frontier = {}, [root_pid]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = titles[pid]
                frontier.append(pid)
    return found


def alive(pids: set[int]) -> set[int]:
    """The processes of ``pids`` still running (a zombie counts as gone)."""
    return {pid for pid in pids if os.path.exists(f"/proc/{pid}") and "zombie" not in _state(pid)}


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/status").read()
    except OSError:
        return "zombie"  # gone meanwhile


def cmdline(pid: int) -> str:
    """The process's command line (first 200 characters), "?" once it is gone."""
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def wait_idle(orch: OrchProcess, timeout_s: float = 60) -> None:
    """Every instance: all blocks free, nothing queued or running; router: nothing in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = orch.status()
        if not busy_instances(status.instances) and status.in_flight == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout_s} s: {status}")
        time.sleep(0.1)
