"""The measurements of scripts/device_check.py: each returns a dict of figures (no verdict:
device_check.py's ``LIMITS`` judges them). ``Sizes`` scales them: the device run (batch 32 x
4K context...) or the CPU dry run (tiny). Also the body of check 5's two pair processes:
``python scripts/device_check_runs.py pair-peer ROLE PORT DEVICE TIMEOUT_S``.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.graph import GraphConfig  # noqa: E402
from engine.quant.writer import quantize_checkpoint  # noqa: E402
from engine.runner import ModelRunner, SeqStep  # noqa: E402

BLOCK = 16


@dataclass(frozen=True)
class Sizes:
    """How big each check runs. prompt/steps: checks 1, 4, 6; batch x context: check 3
    (with its checkpoint's widths ``wide``); graph_steps: timed steps of check 4, whose
    checkpoint is the tiny one with ``graph_model`` (the dry run: one dense layer, a
    cheaper CPU compile); roofline_graph: check 3's step runs captured (a bucket of
    ``batch``: the step as served, without eager launch overhead)."""

    prompt: int
    steps: int
    batch: int
    context: int
    wide: dict
    graph_steps: int
    peer_timeout_s: float
    graph_model: dict
    roofline_graph: bool


DEVICE_SIZES = Sizes(prompt=300, steps=16, batch=32, context=4096, graph_steps=50,
                     peer_timeout_s=10.0,
                     wide=dict(hidden_size=1024, num_heads=16, kv_lora_rank=512,
                               n_routed_experts=64, num_layers=8, q_lora_rank=384),
                     graph_model={}, roofline_graph=True)
DRY_SIZES = Sizes(prompt=24, steps=4, batch=4, context=256, graph_steps=5, peer_timeout_s=3.0,
                  wide=dict(num_layers=2),
                  graph_model=dict(num_layers=1, first_k_dense_replace=1, vocab_size=512),
                  roofline_graph=False)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _runner(ckpt, device: str, blocks: int, dtype=torch.float32, **kwargs) -> ModelRunner:
    return ModelRunner(ckpt, num_kv_blocks=blocks, block_size=BLOCK, dtype=dtype,
                       device=device, **kwargs)


def greedy(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[list, list[int]]:
    """Prefill ``prompt`` then ``steps`` greedy decode steps: (logits ``[V]`` per step on the
    CPU, generated token ids)."""
    table = tuple(range(-(-(len(prompt) + steps) // BLOCK)))
    logits = runner.execute([SeqStep("r", tuple(prompt), 0, table)])[0]
    out, tokens = [logits.float().cpu()], []
    for i in range(steps):
        tokens.append(int(logits.argmax()))
        logits = runner.execute([SeqStep("r", (tokens[-1],), len(prompt) + i, table)])[0]
        out.append(logits.float().cpu())
    return out, tokens


def _prompt(n: int, vocab: int = 129280) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def _compare(a: tuple[list, list[int]], b: tuple[list, list[int]]) -> dict:
    diffs = [float((x - y).abs().max()) for x, y in zip(a[0], b[0])]
    return {"max_logit_diff": max(diffs), "tokens_equal": a[1] == b[1]}


def engine_parity(device: str, ckpt, sizes: Sizes) -> dict:
    """Check 1: fp32 (TF32 off) logits and greedy tokens, ``device`` vs the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    blocks = -(-(sizes.prompt + sizes.steps) // BLOCK)
    runs = [greedy(_runner(ckpt, dev, blocks), _prompt(sizes.prompt), sizes.steps)
            for dev in ("cpu", device)]
    return _compare(*runs)


def quant_parity(device: str, ckpt, sizes: Sizes, tmp: Path) -> dict:
    """Check 6: FP8-block and W8A8 checkpoints of ``ckpt`` load on ``device`` and give the
    CPU's logits (per scheme: max |diff|, tokens equal)."""
    out = {}
    for scheme in ("fp8-block", "w8a8"):
        quantized = quantize_checkpoint(ckpt, tmp / scheme, scheme)
        out[scheme] = engine_parity(device, quantized, sizes)
    return {"max_logit_diff": max(v["max_logit_diff"] for v in out.values()),
            "tokens_equal": all(v["tokens_equal"] for v in out.values()), "schemes": out}


def step_bytes(runner: ModelRunner, batch: int, context: int) -> int:
    """Bytes one decode step reads at least: every weight but the routed experts and the
    embedding, the routed experts a batch can touch (expected distinct experts of ``batch``
    tokens x top-k of E, uniform routing), ``batch`` embedding rows, and the KV of
    ``context`` tokens per sequence in every layer."""
    cfg = runner.model_config
    expert = embed = other = 0
    for name, p in runner.model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            expert += nbytes
        elif "embed_tokens" in name:
            embed += nbytes
        else:
            other += nbytes
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = 1 - (1 - k / e) ** batch
    kv = batch * context * runner.kv_spec.bytes_per_token  # every layer's buffers
    return int(other + expert * touched + embed // cfg.vocab_size * batch + kv)


def _timed(device: str, fn, repeats: int) -> float:
    """Best seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def mla_roofline(device: str, ckpt, sizes: Sizes, hbm_gb_s: float) -> dict:
    """Check 3: one decode step of ``batch`` sequences of ``context`` cached tokens (the KV
    is whatever the cache holds: the step reads it all the same; captured when
    ``sizes.roofline_graph``, eager if that bucket's capture failed: ``graph`` says which)
    vs bytes / HBM bandwidth.
    ``fraction_of_roofline`` = roofline time / measured time (1.0: at the roofline)."""
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    per = -(-(sizes.context + 1) // BLOCK)
    graph = GraphConfig(enabled=sizes.roofline_graph, batch_sizes=(sizes.batch,), warmup=True)
    runner = _runner(ckpt, device, sizes.batch * per, dtype, graph=graph)
    steps = [SeqStep(str(b), (7,), sizes.context, tuple(range(b * per, (b + 1) * per)))
             for b in range(sizes.batch)]
    best = _timed(device, lambda: runner.execute(steps), 5)
    roof = step_bytes(runner, sizes.batch, sizes.context) / (hbm_gb_s * 1e9)
    return {"batch": sizes.batch, "context": sizes.context, "step_ms": best * 1e3,
            "roofline_ms": roof * 1e3, "fraction_of_roofline": roof / best,
            "hbm_gb_s": hbm_gb_s, "dtype": str(dtype),
            "graph": runner.graphs.status() if runner.graphs is not None else "off"}


def graph_decode(device: str, ckpt, sizes: Sizes) -> dict:
    """Check 4: graph decode (the device's default capture backend, bucket 1) vs eager at
    batch 1: greedy logits/tokens, and the step time of each."""
    blocks = -(-(sizes.prompt + sizes.steps + sizes.graph_steps + 2) // BLOCK)
    eager = _runner(ckpt, device, blocks)
    graph = _runner(ckpt, device, blocks,
                    graph=GraphConfig(enabled=True, batch_sizes=(1,), warmup=True))
    prompt = _prompt(sizes.prompt, eager.model_config.vocab_size)
    figures = _compare(greedy(eager, prompt, sizes.steps), greedy(graph, prompt, sizes.steps))
    table = tuple(range(blocks))
    times = {}
    for name, runner in (("eager", eager), ("graph", graph)):
        pos = sizes.prompt + sizes.steps

        def step(runner=runner) -> None:
            runner.execute([SeqStep("r", (7,), pos, table)])
        times[name] = _timed(device, step, sizes.graph_steps)
    return {**figures, "captured": graph.graphs.status()["captured"],
            "eager_ms": times["eager"] * 1e3, "graph_ms": times["graph"] * 1e3,
            "speedup": times["eager"] / times["graph"]}


def killed_peer(device: str, sizes: Sizes) -> dict:
    """Check 5: two pair processes; the decode one is killed (SIGKILL) while the prefill one
    waits on the pair; the prefill process must see a pair error, abort the group and live
    on. Two GPUs: an NCCL pair (cuda:0, cuda:1); one GPU or cpu: the same-node pair's gloo
    group (NCCL refuses two ranks on one GPU)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = device.startswith("cuda") and torch.cuda.device_count() > 1
    devices = ("cuda:0", "cuda:1") if two else (device, device)
    cmd = [sys.executable, __file__, "pair-peer"]
    victim = subprocess.Popen(cmd + ["decode", str(port), devices[1],
                                     str(sizes.peer_timeout_s)], stdout=subprocess.PIPE,
                              text=True)
    survivor = subprocess.Popen(cmd + ["prefill", str(port), devices[0],
                                       str(sizes.peer_timeout_s)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready = victim.stdout.readline().strip()  # the group is up on both sides
        victim.send_signal(signal.SIGKILL)
        text, _ = survivor.communicate(timeout=sizes.peer_timeout_s * 3 + 60)
    finally:
        for proc in (victim, survivor):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    lines = text.strip().splitlines()
    return {"backend": lines[0] if lines else "?", "victim_ready": ready == "ready",
            "survivor_exit": survivor.returncode,
            "peer_survived": survivor.returncode == 0 and "alive" in lines,
            "pair_error": next((l for l in lines if l.startswith("error")), "")[:300]}


def pair_peer(role: str, port: int, device: str, timeout_s: float) -> None:
    """Body of one check-5 process (see :func:`killed_peer`); prints its backend, then
    (prefill) ``error ...`` for the pair error and ``alive`` when it outlived it."""
    import torch.distributed as dist

    from kv_transfer.backend import backend_for
    from kv_transfer.pair import group_backend

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    rank = 1 if role == "decode" else 0
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 1, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    one_gpu = device.startswith("cuda") and torch.cuda.device_count() < 2
    backend = group_backend(backend_for(device), same_node=one_gpu or device == "cpu")
    on = "cpu" if backend.name == "gloo" else device
    group = backend.make_group(dist.PrefixStore("pair", store), rank, 60.0, "127.0.0.1")
    buf = torch.ones(1024, device=on)
    if rank == 1:
        backend.wait(group.send([buf], 0, 0), 60.0)
        print("ready", flush=True)
        time.sleep(3600)
        return
    print(backend.name, flush=True)
    backend.wait(group.recv([buf], 1, 0), 60.0)
    try:
        backend.wait(group.recv([buf], 1, 0), timeout_s)  # the peer is killed meanwhile
        print("error: none (the dead peer's receive completed)", flush=True)
    except Exception as exc:  # noqa: BLE001 - the figure: which error, and did we live
        print(f"error {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
    backend.abort(group)
    time.sleep(2.0)  # NOTE: a watchdog that tears the process down would do it by now
    print("alive", flush=True)
    os._exit(0)  # NOTE: skip the destructor of a group whose peer is gone


if __name__ == "__main__" and sys.argv[1:2] == ["pair-peer"]:
    pair_peer(sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5]))
