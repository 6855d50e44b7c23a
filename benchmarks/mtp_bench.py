"""MTP speculative decoding: acceptance rate, tokens per decode step and TPOT with and
without MTP, at batch 1 and 8, on a tiny model whose main and MTP heads learned something.

First trains the tiny model on CPU (benchmarks/mtp_train.py: a chain language, a few
minutes), then serves it in-process through the real leader path (a colocated rank: scheduler
-> draft / verify step -> rejection of wrong drafts -> token events, no Ray): greedy requests
of ``--prompt`` tokens from held-out chain sequences, ``--max-tokens`` N each. TPOT is the
decode time per output token, ``(wall(N) - wall(1)) / (N - 1)`` with ``wall(n)`` the time the
batch takes to finish with ``max_tokens`` n, in wall time and in this process's CPU time (on a
shared machine the CPU figure is the one other processes barely move); each is the best of
``--repeats`` runs, the runs of every configuration alternating so that machine load hits
them alike. Checks that
greedy output with MTP equals output without, token for token. Not a test; run:
``PYTHONPATH=. python benchmarks/mtp_bench.py``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.mtp_train import chain_batch, train_tiny_mtp
from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Generate
from rank.rank import Rank


def start_rank(ckpt: Path, k: int, batch: int) -> Rank:
    scheduler = SchedulerConfig(block_size=16, num_kv_blocks=8 * batch + 8, chunk_size=256,
                                max_num_batched_tokens=256 + batch * k, max_num_seqs=batch,
                                num_speculative_tokens=k)
    cfg = InstanceConfig(name="colocated-0", role="colocated", checkpoint_dir=str(ckpt),
                         scheduler=scheduler)
    rank = Rank(cfg, 0, ColocatedRole)
    rank.start_alone()
    return rank


def run_batch(rank: Rank, prompts: list[list[int]], max_tokens: int, tag: str
              ) -> tuple[list[list[int]], float, float]:
    """Serve ``prompts`` at once; (tokens per request, wall seconds until all finished, CPU
    seconds of this process meanwhile).

    NOTE: nobody polls events while the batch runs (a polling thread takes the GIL from the
    leader's loop after every token event and would be measured too): the wait sleeps in
    1 ms steps, then the events are read."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    t0, c0 = time.perf_counter(), time.process_time()
    for rid, prompt in zip(ids, prompts):
        rank.request(Generate(RequestSpec(rid, tuple(prompt), SamplingParams(
            max_tokens=max_tokens, ignore_eos=True))))
    deadline = time.monotonic() + 300
    while rank.role.num_active():
        assert time.monotonic() < deadline, "the benchmark's requests did not finish"
        time.sleep(0.001)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = {rid: [] for rid in ids}
    for ev in rank.poll(0.0):
        assert ev.error is None, ev.error
        tokens[ev.request_id].extend(ev.token_ids)
    return [tokens[r] for r in ids], wall, cpu


def bench(ckpt: Path, batches: tuple[int, ...], ks: tuple[int, ...], prompt_len: int,
          max_tokens: int, repeats: int, vocab: int) -> list[dict]:
    """One row per (batch, k): TPOT (best of ``repeats``), acceptance, tokens per step."""
    gen = torch.Generator().manual_seed(12345)  # NOTE: not the training stream
    rows = []
    for batch in batches:
        prompts = chain_batch(batch, prompt_len, vocab, gen).tolist()
        ranks = {k: start_rank(ckpt, k, batch) for k in ks}
        try:
            for rank in ranks.values():  # warm-up
                run_batch(rank, prompts[:1], 4, "warm")
            best = {(k, n, c): float("inf") for k in ks for n in (1, max_tokens)
                    for c in (0, 1)}
            outputs = {}
            for rep in range(repeats):
                for k, rank in ranks.items():
                    for n in (1, max_tokens):
                        out, wall, cpu = run_batch(rank, prompts, n, f"b{batch}r{rep}n{n}")
                        best[k, n, 0] = min(best[k, n, 0], wall)
                        best[k, n, 1] = min(best[k, n, 1], cpu)
                        outputs[k] = out
            # NOTE: TPOT = decode time per output token: (t(N) - t(1)) / (N - 1), wall and
            # process CPU time (the latter barely moved by other processes on the machine)
            tpot = {(k, c): (best[k, max_tokens, c] - best[k, 1, c]) / (max_tokens - 1)
                    for k in ks for c in (0, 1)}
            for k, rank in ranks.items():
                st = rank.status()
                rows.append(dict(batch=batch, k=k, tpot_ms=tpot[k, 0] * 1e3,
                                 ratio=tpot[k, 0] / tpot[ks[0], 0],
                                 cpu_ms=tpot[k, 1] * 1e3, cpu_ratio=tpot[k, 1] / tpot[ks[0], 1],
                                 accept=st.spec_acceptance_rate,
                                 per_step=st.spec_mean_accepted_length or 1.0,
                                 same=outputs[k] == outputs[ks[0]]))
        finally:
            for rank in ranks.values():
                rank.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--checkpoint", default="", help="train into this folder, or reuse the "
                    "checkpoint already trained there (default: a temporary folder)")
    ns = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(ns.checkpoint or Path(tmp) / "ckpt")
        if not (ckpt / "model.safetensors").exists():
            t0 = time.perf_counter()
            _, main_loss, mtp_loss = train_tiny_mtp(
                ckpt, steps=ns.train_steps, num_layers=ns.layers, vocab=ns.vocab, log_every=50)
            print(f"trained {ns.train_steps} steps in {time.perf_counter() - t0:.0f} s: main "
                  f"loss {main_loss:.3f}, MTP loss {mtp_loss:.3f} (hidden 64, {ns.layers} "
                  f"layers + MTP, vocab {ns.vocab}, fp32, 1 thread)")
        rows = bench(ckpt, tuple(ns.batches), tuple(ns.ks), ns.prompt, ns.max_tokens,
                     ns.repeats, ns.vocab)
    print(f"{'batch':>5} {'k':>2} {'TPOT ms':>8} {'vs k=0':>7} {'CPU ms':>7} {'vs k=0':>7} "
          f"{'accept':>7} {'tok/step':>9} {'same tokens':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['k']:>2} {r['tpot_ms']:>8.2f} {r['ratio']:>7.2f} "
              f"{r['cpu_ms']:>7.2f} {r['cpu_ratio']:>7.2f} {r['accept']:>7.2f} "
              f"{r['per_step']:>9.2f} {str(r['same']):>12}")


if __name__ == "__main__":
    main()
