"""Do grammar requests slow down the requests beside them? One in-process colocated rank (the
tiny checkpoint, TP 1, one thread), decode of ``--batch`` requests, in one session:

- ``plain``: ``--batch`` greedy requests without any processing (the baseline);
- ``mixed``: the same batch where ``--grammar`` of them follow a regex (llguidance mask on
  every step) and the rest are the plain ones, unchanged.

Reported per run: the plain requests' mean time per output token (TPOT: first to last token of
each, over its tokens after the first), the leader's ``forward`` (the grammar masks are
computed beside it on a worker thread) and ``sample`` phases per step (where the masks are
applied), the process's CPU time per step (all its threads: the work itself, which other
load on the machine does not move), and the ratios mixed / plain. The plain requests' outputs must be equal in
both runs (the grammar rows never touch theirs). Not a test; run:
``PYTHONPATH=. .venv/bin/python benchmarks/grammar_bench.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.request import RequestSpec
from engine.sampling_params import GrammarSpec, SamplingParams
from orchestrator.tiny_model import write_tiny_checkpoint
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Generate
from rank.rank import Rank

# NOTE: min_tokens = max_tokens keeps EOS masked: the grammar requests never end early
REGEX = "[a-z ]*"


def start_rank(ckpt: Path, batch: int) -> Rank:
    scheduler = SchedulerConfig(block_size=16, num_kv_blocks=1024, chunk_size=512,
                                max_num_batched_tokens=512, max_num_seqs=batch)
    cfg = InstanceConfig(name="colocated-0", role="colocated", checkpoint_dir=str(ckpt),
                         scheduler=scheduler)
    rank = Rank(cfg, 0, ColocatedRole)
    rank.start_alone()
    return rank


def run(rank: Rank, specs: list[RequestSpec]) -> dict[str, tuple[list[int], list[float]]]:
    """request id -> (tokens, arrival time of each token's event)."""
    for spec in specs:
        rank.request(Generate(spec))
    out: dict[str, tuple[list[int], list[float]]] = {s.request_id: ([], []) for s in specs}
    done: set[str] = set()
    deadline = time.monotonic() + 600
    while len(done) < len(specs) and time.monotonic() < deadline:
        for ev in rank.poll(0.1):
            now = time.monotonic()
            toks, times = out[ev.request_id]
            toks.extend(ev.token_ids)
            times.extend([now] * len(ev.token_ids))
            if ev.finish_reason is not None:
                assert ev.error is None, ev.error
                done.add(ev.request_id)
    return out


def specs_for(batch: int, grammar: int, tokens: int, tag: str) -> list[RequestSpec]:
    """``batch`` requests; the first ``grammar`` follow :data:`REGEX`."""
    out = []
    for i in range(batch):
        prompt = tuple(range(1000 + 13 * i, 1016 + 13 * i))
        if i < grammar:
            params = SamplingParams(max_tokens=tokens, min_tokens=tokens,
                                    grammar=GrammarSpec("regex", REGEX))
        else:
            params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        out.append(RequestSpec(f"{tag}-{'g' if i < grammar else 'p'}{i}", prompt, params))
    return out


def measure(rank: Rank, batch: int, grammar: int, tokens: int, tag: str):
    """(plain requests' outputs by index, their mean TPOT s, {phase: mean s per step} of the
    leader's "forward" and "sample" phases)."""
    timings = rank.leader.step_timer
    before, cpu0 = timings.snapshot(), time.process_time()
    got = run(rank, specs_for(batch, grammar, tokens, tag))
    after, cpu = timings.snapshot(), time.process_time() - cpu0
    steps = after.step.count - before.step.count
    phases = {name: (after.phases[name].total_s - (before.phases[name].total_s
                                                   if name in before.phases else 0.0)) / steps
              for name in ("forward", "sample")}
    phases["cpu"] = cpu / steps
    plain = {rid.split("-p")[1]: v for rid, v in got.items() if "-p" in rid}
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for _, t in plain.values()]
    return {k: v[0] for k, v in plain.items()}, statistics.mean(tpots), phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--grammar", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3,
                        help="plain / mixed runs, alternated; the best (lowest TPOT) of each "
                             "is reported (the machine's other load moves single runs)")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    ckpt = write_tiny_checkpoint(Path(tempfile.mkdtemp()), seed=0)
    rank = start_rank(ckpt, ns.batch)
    try:
        measure(rank, ns.batch, ns.grammar, 8, "warm")  # grammar compiler, matcher cache
        plains, mixeds = [], []
        for r in range(ns.repeats):
            plains.append(measure(rank, ns.batch, 0, ns.tokens, f"a{r}"))
            mixeds.append(measure(rank, ns.batch, ns.grammar, ns.tokens, f"b{r}"))
        plain_out, plain_tpot, plain_ph = min(plains, key=lambda m: m[1])
        mixed_out, mixed_tpot, mixed_ph = min(mixeds, key=lambda m: m[1])
    finally:
        rank.shutdown()
    same = all(plain_out[k] == v for k, v in mixed_out.items())
    print(f"batch {ns.batch}, {ns.grammar} with a regex grammar in 'mixed', {ns.tokens} tokens, "
          f"tiny checkpoint, 1 thread, best of {ns.repeats} alternated runs")
    print("| run | plain requests' TPOT ms | forward ms/step | sample ms/step | "
          "process CPU ms/step |")
    print("|---|---|---|---|---|")
    for name, tpot, ph in ((f"plain ({ns.batch} plain)", plain_tpot, plain_ph),
                           (f"mixed ({ns.batch - ns.grammar} plain + {ns.grammar} grammar)",
                            mixed_tpot, mixed_ph)):
        print(f"| {name} | {tpot * 1e3:.2f} | {ph['forward'] * 1e3:.2f} | "
              f"{ph['sample'] * 1e3:.2f} | {ph['cpu'] * 1e3:.2f} |")
    print(f"| ratio mixed / plain | {mixed_tpot / plain_tpot:.3f} | "
          f"{mixed_ph['forward'] / plain_ph['forward']:.3f} | "
          f"{mixed_ph['sample'] / plain_ph['sample']:.3f} | "
          f"{mixed_ph['cpu'] / plain_ph['cpu']:.3f} |")
    print(f"plain requests' tokens equal in both runs: {same}")


if __name__ == "__main__":
    main()
