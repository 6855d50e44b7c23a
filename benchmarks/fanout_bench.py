"""Step fan-out: a Ray actor call per follower per step vs the step channel, side by side.

A colocated instance of the tiny model at TP=2 (two rank actors on a local Ray). On the
leader, in the same run, step by step:

- empty steps (no model work): the fan-out round trip alone (leader -> follower -> ack);
- decode steps at batch 8 (64-token prompts): the whole step, model included.

"ray" sends each step as ``execute_step.remote`` to the follower and waits on the ref (the
fan-out before the step channel); "channel" is ``SPMDGroup.run_step`` (the step channel).
Each step runs in both modes back to back (order alternating), so both see the same machine
load. Printed: best-of-N per mode (the fastest step, the figure least disturbed by other
processes on a shared machine), the median, and the median of the paired ratios. Then the
leader loop serves 8 concurrent requests and prints its step time breakdown
(``status().step_timings``): the share of a decode step spent outside the model forward.

Not a test; run: ``PYTHONPATH=. python benchmarks/fanout_bench.py``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray
import torch

from engine.runner import SeqStep
from engine.sampling_params import SamplingParams
from orchestrator.tiny_model import write_tiny_checkpoint
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, ParallelConfig, SchedulerConfig
from engine.request import RequestSpec
from rank.failures import await_followers
from rank.messages import Generate
from rank.rank import Rank

BLOCK = 16
PROMPT = 64
BATCH = 8
BLOCKS_PER_SEQ = 64  # 1024 tokens: the prompt plus every timed decode step


class BenchRank(Rank):
    """A rank that can time steps driven by hand (leader only, loop not running)."""

    def time_steps(self, batch: int, steps: int, start: int) -> dict[str, list[float]]:
        """mode ("ray", "channel") -> seconds of each of ``steps`` decode steps of ``batch``
        sequences (batch 0: empty steps) at positions ``start``..; each step runs once per
        mode, back to back, the order alternating (the same token at the same position: the
        same work, the same KV written)."""
        runs = {"ray": self._run_by_ray, "channel": self.leader.ranks.run_step}
        out: dict[str, list[float]] = {"ray": [], "channel": []}
        for i in range(steps):
            step = [SeqStep(str(b), (7,), start + i, _table(b)) for b in range(batch)]
            for mode in ("ray", "channel") if i % 2 == 0 else ("channel", "ray"):
                t0 = time.perf_counter()
                runs[mode](step)
                out[mode].append(time.perf_counter() - t0)
        # NOTE: the hand-driven steps' phases end here as one step: the breakdown of the
        # leader loop leaves them out (StepTimings.since)
        self.step_timer.end_step(0.0)
        return out

    def prefill_all(self, batch: int) -> None:
        """One prompt of ``PROMPT`` tokens per sequence, so decode steps have context."""
        self.leader.ranks.run_step([SeqStep(str(b), tuple(range(2, 2 + PROMPT)), 0, _table(b))
                                    for b in range(batch)])

    def _run_by_ray(self, steps: list) -> None:
        """The fan-out before the step channel: one Ray call per follower per step."""
        bound = self.cfg.parallel.step_timeout_s
        deadline = time.monotonic() + bound
        refs = [p.execute_step.remote(steps, None) for p in self.peers[1:]]
        self.forward(steps)
        await_followers(refs, deadline - time.monotonic(), bound, "a step")


def _table(b: int) -> tuple[int, ...]:
    return tuple(range(b * BLOCKS_PER_SEQ, (b + 1) * BLOCKS_PER_SEQ))


def _config(ckpt: str) -> InstanceConfig:
    return InstanceConfig(
        name="colocated-0", role="colocated", checkpoint_dir=ckpt,
        scheduler=SchedulerConfig(block_size=BLOCK, num_kv_blocks=BATCH * BLOCKS_PER_SEQ + 8,
                                  chunk_size=PROMPT, max_num_batched_tokens=BATCH * PROMPT,
                                  max_num_seqs=BATCH),
        parallel=ParallelConfig(tp=2, step_timeout_s=60))


def _start(ckpt: str) -> list:
    actor = ray.remote(BenchRank).options(num_cpus=0.1, max_concurrency=8)
    ranks = [actor.remote(_config(ckpt), r, ColocatedRole) for r in range(2)]
    host, port = ray.get(ranks[0].open_tp_store.remote(), timeout=60)
    ray.get([r.init_rank.remote(host, port, ranks) for r in ranks], timeout=300)
    return ranks


def _compare(leader, steps: int) -> dict[int, dict[str, list[float]]]:
    """batch (0, ``BATCH``) -> mode -> seconds of each step."""
    ray.get(leader.prefill_all.remote(BATCH), timeout=300)
    return {batch: ray.get(leader.time_steps.remote(batch, steps, PROMPT), timeout=600)
            for batch in (0, BATCH)}


def _serve_breakdown(leader, max_tokens: int) -> str:
    """Serve ``BATCH`` concurrent requests through the leader loop; its breakdown line."""
    before = ray.get(leader.status.remote(), timeout=30).step_timings
    ray.get(leader.start.remote(), timeout=30)
    for i in range(BATCH):
        ray.get(leader.request.remote(Generate(RequestSpec(
            f"b{i}", tuple(range(1000 + i, 1000 + i + PROMPT)),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True)))), timeout=30)
    ended, deadline = set(), time.monotonic() + 600
    while len(ended) < BATCH and time.monotonic() < deadline:
        ended |= {e.request_id for e in ray.get(leader.poll.remote(1.0), timeout=30)
                  if e.finish_reason}
    return ray.get(leader.status.remote(), timeout=30).step_timings.since(before).format()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = str(write_tiny_checkpoint(tmp, seed=0))
            ranks = _start(ckpt)
            try:
                times = _compare(ranks[0], args.steps)
                breakdown = _serve_breakdown(ranks[0], args.max_tokens)
            finally:
                for r in ranks:
                    ray.kill(r)
    finally:
        ray.shutdown()
    print(f"tiny model, TP=2 colocated, torch {torch.__version__}, {args.steps} steps per "
          "mode; ms per step: best (median); channel/ray: best, median of paired ratios")
    print(f"{'step':<22}{'ray call':>18}{'channel':>18}{'best':>7}{'paired':>8}")
    for batch, name in ((0, "empty (fan-out only)"), (BATCH, f"decode batch {BATCH}")):
        r, c = times[batch]["ray"], times[batch]["channel"]
        cells = [f"{min(t) * 1e3:.3f} ({statistics.median(t) * 1e3:.3f})" for t in (r, c)]
        paired = statistics.median(b / a for a, b in zip(r, c))
        print(f"{name:<22}{cells[0]:>18}{cells[1]:>18}{min(c) / min(r):>7.2f}{paired:>8.2f}")
    print(f"leader loop, {BATCH} concurrent requests, {args.max_tokens} tokens each: {breakdown}")


if __name__ == "__main__":
    main()
