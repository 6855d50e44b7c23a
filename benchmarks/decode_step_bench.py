"""What a decode step costs outside the model forward: one colocated rank in this process
(tp 1, no Ray, the real loop thread: schedule -> forward -> sample -> update -> emit -> flush),
the tiny DeepSeek-V3 checkpoint orch serves (``orch model init-tiny``, seed 0), fp32, one
torch thread.

``--batch`` requests of ``--input-len`` prompt tokens each ask for ``--output-len`` tokens
(greedy, EOS ignored), all at once. Hooks on the model time every forward (the model's
``forward`` alone: no metadata build, no sampler); a steady decode interval is the time from
the start of one decode-only forward of ``batch`` rows to the start of the next. Per step
(median over those intervals, ms): the interval, the model forward, and ``outside`` =
interval - forward, i.e. everything the loop does per step that is not the model (scheduler,
step inputs and attention metadata, sampler, counters, token events, the flush, the loop
itself). The leader's own phase timings (rank/step_timing.py) of the same run follow.

The same split on the loop thread's CPU clock (``time.thread_time``) follows: on a shared,
loaded machine wall intervals include time the thread waited for a core, its CPU seconds
much less so.

``--graph`` builds a second rank beside the eager one, with decode graph mode on (the
"compile" backend, torch.compile/inductor; buckets = the ``--batch`` sizes, all captured
before anything is timed) and runs the rounds alternating between the two (round r starts
with the eager rank when r is even). A captured step's forward is the captured call
(``runner.graphs.run``: module hooks do not fire inside it); both ranks' forwards exclude
the step inputs and metadata. The per-round medians give paired ratios graph / eager.

``--profile`` then stops the loop thread and drives ``--profile-steps`` decode iterations in
this thread under cProfile (thread CPU clock), printing the functions with the most own time.

Run: PYTHONPATH=. .venv/bin/python benchmarks/decode_step_bench.py --batch 1 8 [--graph]
[--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time

import torch

from engine.graph import GraphConfig
from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from orchestrator.tiny_model import write_tiny_checkpoint
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Generate
from rank.rank import Rank


class ForwardClock:
    """Forward pre/post hooks on the model: per forward (start, end, tokens), once on the wall
    clock and once on the calling thread's CPU clock (``time.thread_time``: the loop thread's
    own CPU seconds, which other jobs on a shared machine move little), seconds."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.records: list[tuple[float, float, float, float, int]] = []
        self._t0 = self._c0 = 0.0
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def wrap_graphs(self, graphs) -> None:
        """Time ``graphs.run`` (an :class:`engine.graph.DecodeGraphs`: the captured forward,
        which bypasses the module hooks) as a forward of its ``input_ids`` rows."""
        run = graphs.run

        def timed(bucket: int, input_ids: torch.Tensor, *rest):
            self._pre(None, None)
            out = run(bucket, input_ids, *rest)
            self._post(None, (input_ids,), out)
            return out

        graphs.run = timed

    def _pre(self, module, args) -> None:
        self._t0, self._c0 = time.perf_counter(), time.thread_time()

    def _post(self, module, args, output) -> None:
        self.records.append((self._t0, time.perf_counter(), self._c0, time.thread_time(),
                             int(args[0].shape[0])))

    def decode_intervals(self, batch: int) -> list[tuple[float, float, float, float]]:
        """(interval, forward, interval CPU, forward CPU) seconds of each decode-only forward
        of ``batch`` rows that is followed by another one."""
        return _intervals(self.records, batch)


def make_rank(ckpt: str, batch: int, input_len: int, output_len: int,
              graph: GraphConfig | None = None) -> Rank:
    """A started colocated rank (``graph``: its decode graph mode; warmup captures first)."""
    blocks = batch * -(-(input_len + output_len) // 16) + 16
    sched = SchedulerConfig(block_size=16, num_kv_blocks=blocks, chunk_size=64,
                            max_num_batched_tokens=256, max_num_seqs=max(8, batch),
                            prefix_cache=False)
    cfg = InstanceConfig(name="colocated-0", role="colocated", checkpoint_dir=ckpt,
                         scheduler=sched, graph=graph or GraphConfig())
    rank = Rank(cfg, 0, ColocatedRole)
    rank.start_alone()
    return rank


def submit(rank: Rank, batch: int, input_len: int, output_len: int, tag: str) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    ids = []
    for i in range(batch):
        prompt = tuple(torch.randint(1000, 100000, (input_len,), generator=gen).tolist())
        rid = f"{tag}-{i}"
        rank.request(Generate(RequestSpec(rid, prompt, SamplingParams(
            max_tokens=output_len, ignore_eos=True))))
        ids.append(rid)
    return ids


def wait_done(rank: Rank, ids: list[str], timeout_s: float = 600.0) -> dict[str, list[int]]:
    """request id -> its tokens, polling the leader's events (bounded by ``timeout_s``)."""
    tokens = {i: [] for i in ids}
    done: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(done) < len(ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests not finished within {timeout_s} s: "
                               f"{sorted(set(ids) - done)}")
        for ev in rank.poll(0.5):
            tokens[ev.request_id] += list(ev.token_ids)
            if ev.finish_reason is not None:
                if ev.error:
                    raise RuntimeError(f"{ev.request_id}: {ev.error}")
                done.add(ev.request_id)
    return tokens


def measure(ckpt: str, batch: int, args: argparse.Namespace) -> list[dict]:
    """One rank per mode (eager; graph with ``--graph``), a warm-up round on each, then
    ``--rounds`` timed rounds of ``batch`` requests, alternating the modes; one row each."""
    # NOTE: KV for the profile's longer requests too, or fewer than ``batch`` of them run
    longest = max(args.output_len, args.profile_steps + 64 if args.profile else 0)
    modes = {"eager": GraphConfig()}
    if args.graph:
        modes["graph"] = GraphConfig(enabled=True, batch_sizes=tuple(sorted(set(args.batch))),
                                     warmup=True, backend="compile", required=True)
    ranks: dict[str, Rank] = {}
    try:
        for name, graph in modes.items():
            ranks[name] = make_rank(ckpt, batch, args.input_len, longest, graph)
        clocks = {name: ForwardClock(rank.runner.model) for name, rank in ranks.items()}
        for name, rank in ranks.items():
            if rank.runner.graphs is not None:
                clocks[name].wrap_graphs(rank.runner.graphs)
            wait_done(rank, submit(rank, batch, args.input_len, 4, "warm"))
        before = {name: rank.status().step_timings for name, rank in ranks.items()}
        for clock in clocks.values():
            clock.records.clear()
        per_round: dict[str, list[float]] = {name: [] for name in ranks}
        for r in range(args.rounds):
            order = list(ranks) if r % 2 == 0 else list(ranks)[::-1]
            for name in order:  # NOTE: alternating: load changes hit every mode alike
                start = len(clocks[name].records)
                wait_done(ranks[name], submit(ranks[name], batch, args.input_len,
                                              args.output_len, f"r{r}"))
                pairs = _intervals(clocks[name].records[start:], batch)
                per_round[name].append(statistics.median(p[2] for p in pairs))
        return [_row(name, batch, ranks[name], clocks[name], before[name], per_round[name],
                     args) for name in ranks]
    finally:
        for rank in ranks.values():
            rank.shutdown()


def _row(mode: str, batch: int, rank: Rank, clock: ForwardClock, before, round_cpu: list[float],
         args: argparse.Namespace) -> dict:
    """One mode's figures (ms): medians over every timed step, the per-round CPU medians,
    the leader's phases since ``before``, and the profile with ``--profile``."""
    pairs = clock.decode_intervals(batch)
    row = {"mode": mode, "batch": batch, "steps": len(pairs),
           "interval_ms": 1e3 * statistics.median(p[0] for p in pairs),
           "forward_ms": 1e3 * statistics.median(p[1] for p in pairs),
           "outside_ms": 1e3 * statistics.median(p[0] - p[1] for p in pairs),
           "interval_cpu_ms": 1e3 * statistics.median(p[2] for p in pairs),
           "forward_cpu_ms": 1e3 * statistics.median(p[3] for p in pairs),
           "outside_cpu_ms": 1e3 * statistics.median(p[2] - p[3] for p in pairs),
           "round_cpu_ms": [1e3 * t for t in round_cpu],
           "phases": rank.status().step_timings.since(before).format()}
    if args.profile:
        row["profile"] = profile_steps(rank, batch, args)
    return row


def _intervals(records: list, batch: int) -> list[tuple[float, float, float, float]]:
    """:meth:`ForwardClock.decode_intervals` over a slice of its records."""
    return [(b[0] - a[0], a[1] - a[0], b[2] - a[2], a[3] - a[2])
            for a, b in zip(records, records[1:]) if a[4] == batch and b[4] == batch]


def profile_steps(rank: Rank, batch: int, args: argparse.Namespace) -> str:
    """cProfile of ``--profile-steps`` decode iterations driven in this thread (loop
    stopped); the top functions by own time."""
    loop = rank.loop
    loop.stop()
    submit(rank, batch, args.input_len, args.profile_steps + 64, "prof")
    sched = rank.leader.scheduler
    while sched.waiting or any(r.num_tokens - r.num_computed_tokens > 1
                               for r in sched.running):
        loop._iterate()  # prefill until every request decodes
        loop._flush()
    if len(sched.running) != batch:
        raise RuntimeError(f"profile: {len(sched.running)} requests decode, not {batch}")
    prof = cProfile.Profile(time.thread_time)  # NOTE: CPU seconds of this thread
    prof.enable()
    for _ in range(args.profile_steps):
        loop._iterate()
        loop._flush()
    prof.disable()
    rank.leader.poll(0.0)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(15)
    # NOTE: the loop's own functions by cumulative time: what a step does besides the model
    stats.sort_stats("cumulative").print_stats(r"rank/|engine/(runner|scheduler|sampling|"
                                              r"forward_context|decode_step_cache)", 30)
    return out.getvalue()


def print_paired(rows: list[dict]) -> None:
    """Per batch with both modes: graph / eager of each round's median loop-thread CPU
    interval (rounds alternate, so each pair saw the same load): median [range]."""
    by = {(r["mode"], r["batch"]): r["round_cpu_ms"] for r in rows}
    for batch in sorted({r["batch"] for r in rows}):
        if ("graph", batch) not in by:
            continue
        ratios = sorted(g / e for g, e in zip(by[("graph", batch)], by[("eager", batch)]))
        print(f"batch {batch}: graph / eager step (loop thread CPU), paired per round: "
              f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--graph", action="store_true",
                    help="also a rank with decode graph mode on (compile backend, buckets = "
                         "--batch, captured first), alternating rounds with the eager one")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-steps", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(write_tiny_checkpoint(tmp, seed=0))
        rows = [row for b in args.batch for row in measure(ckpt, b, args)]
    print(f"decode step, tiny model, {args.input_len}-token prompts, {args.output_len} output "
          f"tokens, {args.rounds} rounds; medians over steady decode steps (ms)")
    print("| mode | batch | steps | interval | model forward | outside forward | loop thread "
          "CPU: interval | forward | outside |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['batch']} | {r['steps']} | {r['interval_ms']:.2f} | "
              f"{r['forward_ms']:.2f} | {r['outside_ms']:.2f} | {r['interval_cpu_ms']:.2f} | "
              f"{r['forward_cpu_ms']:.2f} | {r['outside_cpu_ms']:.2f} |")
    print_paired(rows)
    for r in rows:
        print(f"{r['mode']} batch {r['batch']} leader phases: {r['phases']}")
        if "profile" in r:
            print(r["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
