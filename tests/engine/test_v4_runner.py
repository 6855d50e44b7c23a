"""The rank's runner serving DeepSeek-V4 (engine/v4/runner.py) under the real scheduler
(colocated policy, chunked prefill, continuous batching): greedy tokens equal transformers'
``DeepseekV4ForCausalLM`` (argmax of a full forward per token), and every V4 block goes back
when the scheduler frees the request's block set."""

from __future__ import annotations

import pytest
import torch

from engine.block_pool import BlockPool
from engine.request import Request, RequestSpec
from engine.runner import ModelRunner, build_runner
from engine.sampling_params import SamplingParams
from engine.scheduler import COLOCATED, Scheduler
from engine.v4.runner import V4Runner

BLOCK, BLOCKS, NEW = 16, 24, 32
# NOTE: lengths around the window (8) and the ratios (4, 16); 3 requests at once, 2nd late
PROMPTS = {"a": 21, "b": 6, "c": 35}


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 129000, (n,), generator=torch.Generator().manual_seed(seed))
                 .tolist())


@pytest.fixture(scope="module")
def hf_greedy(tiny_v4_ckpt):
    from transformers import DeepseekV4ForCausalLM  # noqa: PLC0415 (reference only)

    hf = DeepseekV4ForCausalLM.from_pretrained(tiny_v4_ckpt, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    out = {}
    with torch.no_grad():  # NOTE: argmax of a full forward per token (EOS ignored, as served)
        for seed, (rid, n) in enumerate(PROMPTS.items()):
            ids = list(_prompt(n, seed))
            for _ in range(NEW):
                ids.append(int(hf(torch.tensor(ids)[None]).logits[0, -1].argmax()))
            out[rid] = ids[n:]
    return out


def _serve(runner: V4Runner) -> dict[str, list[int]]:
    """Run PROMPTS through a colocated scheduler (chunk 8: prompts split inside compression
    groups) until each has NEW tokens; ``b`` arrives after 3 steps."""
    pool = BlockPool(BLOCKS, BLOCK)
    pool.on_free = runner.release
    sched = Scheduler(pool, COLOCATED, chunk_size=8, max_num_batched_tokens=20,
                      max_num_seqs=4)
    specs = {rid: RequestSpec(rid, _prompt(n, seed), SamplingParams(max_tokens=NEW,
                                                                     ignore_eos=True))
             for seed, (rid, n) in enumerate(PROMPTS.items())}
    sched.add(Request(specs["a"]))
    sched.add(Request(specs["c"]))
    done, steps = {}, 0
    while len(done) < len(specs):
        if steps == 3:
            sched.add(Request(specs["b"]))
        out = sched.schedule()
        logits = runner.execute(out.steps)
        sampled = {c.request.request_id: int(logits[i].argmax())
                   for i, c in enumerate(out.chunks) if c.completes}
        sched.update(out, sampled)
        for c in out.chunks:
            if len(c.request.output_token_ids) == NEW:
                done[c.request.request_id] = sched.remove(c.request.request_id).output_token_ids
        steps += 1
    return done


def test_runner_serves_v4_batched_equal_to_hf(tiny_v4_ckpt, hf_greedy):
    runner = build_runner(tiny_v4_ckpt, num_kv_blocks=BLOCKS, block_size=BLOCK)
    assert isinstance(runner, V4Runner)
    assert _serve(runner) == hf_greedy
    runner.execute_empty()  # NOTE: no-op; the release of the last request applies next step
    runner._apply_releases()
    assert runner.num_live_requests() == 0
    assert all(p.num_free_blocks == p.num_blocks for p in runner.pools.values())


def test_window_blocks_are_freed_during_decode(tiny_v4_ckpt):
    """A 35-token prompt + 32 decoded tokens holds at most 2 window blocks of 16 (window 8)."""
    runner = build_runner(tiny_v4_ckpt, num_kv_blocks=BLOCKS, block_size=BLOCK)
    pool = BlockPool(BLOCKS, BLOCK)
    blocks = pool.allocate(pool.blocks_needed(35 + NEW))
    from engine.runner import SeqStep  # noqa: PLC0415

    prompt = _prompt(35, 0)
    logits = runner.execute([SeqStep("r", prompt, 0, blocks.block_ids)])
    for n in range(35, 35 + NEW):
        logits = runner.execute([SeqStep("r", (int(logits[0].argmax()),), n,
                                         blocks.block_ids)])
        assert runner.caches["r"].blocks.held()["window"] <= 2
    used = BLOCKS - runner.pools["window"].num_free_blocks
    assert used <= 2


def test_unsupported_layouts_are_refused(tiny_v4_ckpt):
    with pytest.raises(ValueError, match="tp=2.*MTP.*prefix cache"):
        build_runner(tiny_v4_ckpt, num_kv_blocks=4, block_size=BLOCK,
                     tp=type("G", (), {"size": 2})(), num_speculative_tokens=1,
                     prefix_cache=True)
    runner = build_runner(tiny_v4_ckpt, num_kv_blocks=4, block_size=BLOCK)
    with pytest.raises(ValueError, match="colocated"):
        runner.kv_cache  # noqa: B018 (a PD role's first use)


def test_v3_checkpoint_still_gets_model_runner(tiny_ckpt):
    assert isinstance(build_runner(tiny_ckpt, num_kv_blocks=2, block_size=BLOCK), ModelRunner)
