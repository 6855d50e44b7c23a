"""One short check on a machine with one GPU: run it whenever a GPU is at hand.

1. Engine parity: the tiny DeepSeek-V3 checkpoint, fp32 (TF32 off), on the device and on the
   CPU: a 300-token prefill and 16 greedy decode steps; max |logits difference| per step and
   the greedy tokens (must be identical).
2. Serving on that one device: ``orch up`` of the tiny model colocated (tp 1) and 1P1D
   (prefill tp 1 -> decode tp 1, both ranks on the one GPU through
   ``cluster.accelerators_per_rank: 0.5``, so the KV moves between two processes of one
   node); the same greedy prompts through the gRPC client; the two outputs must be equal
   token for token.
3. Decode step time vs the HBM roofline: a wider random checkpoint (hidden 1024, 8 layers,
   64 experts, kv_lora_rank 512, bf16), decode steps at batch 1, 8, 32 over a 1K-token
   context; bytes one step must read (every non-expert weight, the experts the batch can
   touch, the KV of the context) / the device's HBM bandwidth (orchestrator/planner/
   devices.yaml) against the measured step (eager; torch.cuda.synchronize around it).

Run (from the repository root, after ``bash scripts/setup.sh``; ~3 min on an H100/H200)::

    .venv/bin/python scripts/device_check.py [--device cuda] [--out DIR] [--skip-serve]

``--device cpu`` runs the same code on the CPU (parity against itself; the roofline against
the ``cpu`` figure given by ``--hbm-gb-s``): how the script itself is tested without a GPU.
Prints one line per check and writes ``DIR/device_check.json``; exits 0 when every check
passed, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.runner import ModelRunner, SeqStep  # noqa: E402
from orchestrator.tiny_model import write_tiny_checkpoint  # noqa: E402

BLOCK = 16
PARITY_TOL = 1e-3  # fp32 logits, device vs CPU (different GEMM orderings; TF32 off)


# ---- 1. engine parity ---------------------------------------------------------------------
def greedy_run(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[list, list[int]]:
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


def engine_parity(device: str, ckpt: str) -> dict:
    """Check 1: max logits difference per step and whether the greedy tokens match."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    prompt = torch.randint(2, 129280, (300,), generator=torch.Generator().manual_seed(0))
    runs = {}
    for dev in ("cpu", device):
        runner = ModelRunner(ckpt, num_kv_blocks=32, block_size=BLOCK, dtype=torch.float32,
                             device=dev)
        runs[dev] = greedy_run(runner, prompt.tolist(), 16)
    diffs = [float((a - b).abs().max()) for a, b in zip(runs["cpu"][0], runs[device][0])]
    same = runs["cpu"][1] == runs[device][1]
    return {"ok": same and max(diffs) <= PARITY_TOL, "max_logit_diff": max(diffs),
            "tokens_equal": same, "tolerance": PARITY_TOL}


# ---- 2. serving on one device ---------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(name: str, device: str, out: Path) -> Path:
    """configs/NAME.yaml for one device: tp 1, ranks sharing the device, free ports."""
    data = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    data["decode"]["tp"] = 1
    data["router"].update(port=_free_port(), metrics_port=_free_port())
    data["cluster"].update(device=device, cpus_per_rank=1, accelerators_per_rank=0.5)
    data["kv_transfer"]["backend"] = "auto"
    path = out / f"{name}_{device}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def serve(name: str, device: str, out: Path, prompts: list[str]) -> list[list[int]]:
    """``orch up`` configs/NAME.yaml on ``device``; greedy token ids of each prompt.

    Raises:
        RuntimeError: orch up exited or did not serve (its log's tail in the message).
    """
    from orchestrator.api.client import OrchClient

    cfg = _config(name, device, out)
    port = yaml.safe_load(cfg.read_text())["router"]["port"]
    log = out / f"{name}_{device}.log"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "up", str(cfg)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    try:
        with OrchClient(f"127.0.0.1:{port}") as client:
            _wait_serving(client, proc, log)
            return [client.generate_text(p, max_tokens=16, temperature=0.0,
                                         timeout_s=120)[1] for p in prompts]
    finally:
        _stop(proc)


def _wait_serving(client, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"orch up exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            client.wait_ready(5)
            return
        except TimeoutError:
            continue
    raise RuntimeError(f"orch up not serving after {timeout_s} s: {log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def serving(device: str, out: Path) -> dict:
    """Check 2: colocated and 1P1D on one device give the same greedy tokens."""
    prompts = [f"Write {n} short facts about the number {n}." for n in range(1, 7)]
    result: dict = {}
    try:
        colocated = serve("colocated", device, out, prompts)
        pd = serve("1p1d", device, out, prompts)
    except Exception as exc:  # noqa: BLE001 - reported as this check's failure
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-2000:]}
    result["requests"] = len(prompts)
    result["tokens_equal"] = colocated == pd
    result["ok"] = colocated == pd and all(len(t) > 0 for t in pd)
    return result


# ---- 3. decode step time vs the HBM roofline ----------------------------------------------
WIDE = dict(hidden_size=1024, num_heads=16, kv_lora_rank=512, n_routed_experts=64,
            num_layers=8, q_lora_rank=384)


def step_bytes(runner: ModelRunner, batch: int, context: int) -> int:
    """Bytes one decode step reads at least: every weight but the routed experts and the
    embedding, the routed experts a batch can touch (expected distinct experts of ``batch``
    tokens x top-k of E, uniform routing), ``batch`` embedding rows, and the KV of
    ``context`` tokens per sequence in every layer."""
    cfg = runner.model_config
    expert, embed, other = 0, 0, 0
    for name, p in runner.model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            expert += nbytes
        elif "embed_tokens" in name:
            embed += nbytes
        else:
            other += nbytes
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch) / e
    kv_per_token = runner.kv_spec.bytes_per_token  # all layers
    embed_rows = embed // cfg.vocab_size * batch
    return int(other + expert * touched + embed_rows
               + batch * context * kv_per_token)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_roofline(device: str, ckpt: str, hbm_gb_s: float, context: int = 1024) -> dict:
    """Check 3 (a report; "ok" when the steps ran): measured decode step vs bytes / HBM
    bandwidth at batch 1, 8, 32."""
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    blocks_per = -(-(context + 16) // BLOCK)
    runner = ModelRunner(ckpt, num_kv_blocks=32 * blocks_per, block_size=BLOCK, dtype=dtype,
                         device=device)
    rows = []
    for batch in (1, 8, 32):
        tables = [tuple(range(b * blocks_per, (b + 1) * blocks_per)) for b in range(batch)]
        for b in range(batch):  # prefill each context alone (a 1K chunk)
            runner.execute([SeqStep(str(b), tuple(range(2, 2 + context)), 0, tables[b])])
        times = []
        for i in range(8):
            _sync(device)
            t0 = time.perf_counter()
            runner.execute([SeqStep(str(b), (7,), context + i, tables[b])
                            for b in range(batch)])
            _sync(device)
            times.append(time.perf_counter() - t0)
        best = min(times[2:])
        roof = step_bytes(runner, batch, context) / (hbm_gb_s * 1e9)
        rows.append({"batch": batch, "step_ms": best * 1e3, "roofline_ms": roof * 1e3,
                     "measured_over_roofline": best / roof})
    return {"ok": True, "context": context, "hbm_gb_s": hbm_gb_s, "dtype": str(dtype),
            "rows": rows}


def device_hbm_gb_s(device: str, override: float | None) -> float:
    """HBM GB/s of this GPU: ``override``, else the devices.yaml entry whose name matches
    ``torch.cuda.get_device_name()`` (H100 / H200 ...).

    Raises:
        SystemExit(2): no entry matches and no override was given.
    """
    if override:
        return override
    from orchestrator.planner.specs import device_table

    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    for spec in device_table().values():
        if spec.platform == "cuda" and spec.key.upper() in name.upper():
            return spec.hbm_gb_s
    print(f"no devices.yaml entry for {name!r}: pass --hbm-gb-s", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, default=None, help="folder for logs + JSON")
    parser.add_argument("--hbm-gb-s", type=float, default=None,
                        help="memory bandwidth to compare against (default: devices.yaml)")
    parser.add_argument("--skip-serve", action="store_true", help="engine checks only")
    parser.add_argument("--context", type=int, default=1024,
                        help="tokens of context per sequence in check 3")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    hbm = device_hbm_gb_s(args.device, args.hbm_gb_s or (20.0 if args.device == "cpu" else None))
    out = args.out or Path(tempfile.mkdtemp(prefix="device_check_"))
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    results = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
               "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        results["engine_parity"] = engine_parity(device, tiny)
        _print("engine parity", results["engine_parity"])
        if not args.skip_serve:
            results["serving"] = serving(args.device, out)
            _print("serving colocated vs 1P1D", results["serving"])
        wide = write_tiny_checkpoint(Path(tmp) / "wide", seed=0, **WIDE)
        results["decode_roofline"] = decode_roofline(device, wide, hbm, args.context)
        _print("decode vs HBM roofline", results["decode_roofline"])
    (out / "device_check.json").write_text(json.dumps(results, indent=2))
    print(f"summary: {out / 'device_check.json'}")
    return 0 if all(v["ok"] for v in results.values() if isinstance(v, dict)) else 1


def _print(what: str, result: dict) -> None:
    status = "PASS" if result["ok"] else "FAIL"
    rows = result.pop("rows", None)
    print(f"[{status}] {what}: " + ", ".join(f"{k}={v}" for k, v in result.items() if k != "ok"))
    for row in rows or ():
        print(f"    batch {row['batch']:>2}: step {row['step_ms']:.3f} ms, roofline "
              f"{row['roofline_ms']:.3f} ms, measured/roofline "
              f"{row['measured_over_roofline']:.1f}x")
    if rows is not None:
        result["rows"] = rows


if __name__ == "__main__":
    sys.exit(main())
