"""Chunked prefill, absorbed vs naive decode, mixed batches, and the one-KV-write rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.engine.engine_drive import blocks_for, generate_greedy
from engine.kernels import KERNELS
from engine.runner import ModelRunner, SeqStep

BLOCK = 16


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 129280, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def runner(tiny_ckpt):
    return ModelRunner(tiny_ckpt, num_kv_blocks=64, block_size=BLOCK)


def _cleared_caches(runner: ModelRunner) -> list[torch.Tensor]:
    """Every layer's K and V cache tensor, zeroed (the runner's own tensors, not copies)."""
    caches = [*runner.kv_cache.k_caches, *runner.kv_cache.v_caches]
    for c in caches:
        c.zero_()
    return caches


# NOTE: tile 4096 holds any prefix in one tile (one LSE merge per chunk); tile 24 splits
# prefixes over up to six tiles (merges of merges, where the merged lse is used again). Chunk 1
# runs every token after the first as a decode step (no merge): the decode path against
# prefill. Every other chunk size runs the merge; chunk 4 (the heads count) lets a
# [T, H] / [H, T] mix-up broadcast silently.
@pytest.mark.parametrize("prefix_tile,chunk", [(4096, 1), (4096, 2), (4096, 4), (4096, 16),
                                               (4096, 50), (24, 2), (24, 7), (24, 16), (24, 64)])
def test_chunked_prefill_equals_one_shot(runner, prefix_tile, chunk, monkeypatch):
    from engine.attention import MLAttention

    monkeypatch.setattr(MLAttention, "prefix_tile", prefix_tile)
    prompt = _prompt(130, seed=3)
    table = blocks_for(0, 130, BLOCK)
    caches = _cleared_caches(runner)
    _, one_shot = generate_greedy(runner, prompt, 1, table)
    ref = [c.clone() for c in caches]
    _cleared_caches(runner)  # every layer: the chunked run must write all it reads
    _, chunked = generate_greedy(runner, prompt, 1, table, chunk=chunk)
    diff = (chunked[0] - one_shot[0]).abs().max().item()
    assert diff <= 1e-5, f"chunk {chunk}: max |diff| {diff}"
    for got, want in zip(caches, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_absorbed_decode_equals_naive_decode(tiny_ckpt, runner):
    naive = ModelRunner(tiny_ckpt, num_kv_blocks=64, block_size=BLOCK,
                        kernel_choices={"mla_decode": "naive"})
    assert naive.kernels.mla_decode is not runner.kernels.mla_decode
    prompt = _prompt(40, seed=4)
    table = blocks_for(0, 40 + 12, BLOCK)
    toks_a, logits_a = generate_greedy(runner, prompt, 12, table)
    toks_n, logits_n = generate_greedy(naive, prompt, 12, table)
    assert toks_a == toks_n
    for step, (a, n) in enumerate(zip(logits_a, logits_n, strict=True)):
        assert (a - n).abs().max().item() <= 1e-5, f"decode step {step}"


def test_mixed_batch_gives_each_request_its_solo_tokens(runner):
    """Prefill chunks and decode steps of requests of different lengths share steps."""
    prompts = {"a": _prompt(45, 10), "b": _prompt(7, 11), "c": _prompt(23, 12)}
    new = 6
    tables = {r: blocks_for(i * 8, len(p) + new, BLOCK) for i, (r, p) in
              enumerate(prompts.items())}
    solo = {r: generate_greedy(runner, p, new, tables[r])[0] for r, p in prompts.items()}

    done = {r: 0 for r in prompts}
    out: dict[str, list[int]] = {r: [] for r in prompts}
    chunk = {"a": 16, "b": 7, "c": 10}
    start_at = {"a": 0, "b": 0, "c": 2}  # c arrives while a prefills and b decodes
    step_no = 0
    while any(len(o) < new for o in out.values()):
        steps = []
        for r, p in prompts.items():
            if step_no < start_at[r] or len(out[r]) >= new:
                continue
            if done[r] < len(p):
                toks = tuple(p[done[r]:done[r] + chunk[r]])
            else:
                toks = (out[r][-1],)
            steps.append(SeqStep(r, toks, done[r], tables[r]))
        logits = runner.execute(steps)
        assert logits.shape == (len(steps), 129280)
        for s, row in zip(steps, logits, strict=True):
            done[s.request_id] += len(s.token_ids)
            if done[s.request_id] >= len(prompts[s.request_id]):
                out[s.request_id].append(int(row.argmax()))
        step_no += 1
    assert out == solo


def test_one_kv_write_per_layer_per_step(tiny_ckpt):
    calls = []
    base = KERNELS.resolve("cpu")

    def counting(entries, caches, slots):
        calls.append((caches[0].data_ptr(), entries[0].shape[0]))
        return base.reshape_and_cache(entries, caches, slots)

    kernels = dataclasses.replace(base, reshape_and_cache=counting)
    runner = ModelRunner(tiny_ckpt, num_kv_blocks=16, block_size=BLOCK, kernels=kernels)
    layers = runner.model_config.num_hidden_layers
    cache_ptrs = [k.data_ptr() for k in runner.kv_cache.k_caches]
    runner.execute([SeqStep("a", tuple(range(5, 25)), 0, (0, 1)),
                    SeqStep("b", tuple(range(30, 33)), 0, (2,))])
    assert calls == [(p, 23) for p in cache_ptrs]
    calls.clear()
    runner.execute([SeqStep("a", (7,), 20, (0, 1)), SeqStep("b", (8, 9), 3, (2,))])
    assert len(calls) == layers and all(n == 3 for _, n in calls)


def test_kv_written_at_slots_and_only_there(runner):
    """The caches hold c_kv / k_pe exactly at the step's slots; other slots are untouched."""
    for k in runner.kv_cache.k_caches + runner.kv_cache.v_caches:
        k.fill_(7.0)
    runner.execute([SeqStep("a", tuple(range(100, 120)), 0, (5, 3))])  # slots 80..95, 48..51
    written = set(range(80, 96)) | set(range(48, 52))
    flat = runner.kv_cache.read(1, torch.arange(runner.kv_cache.spec.num_blocks * BLOCK))[0]
    untouched = [s for s in range(flat.shape[0]) if s not in written]
    assert (flat[untouched] == 7.0).all()
    assert not (flat[sorted(written)] == 7.0).any()
    # K is the normalized latent: RMS of c_kv / weight is 1
    w = runner.model.model.layers[1].self_attn.kv_a_layernorm.weight
    rms = (flat[80] / w).pow(2).mean().sqrt().item()
    assert rms == pytest.approx(1.0, rel=1e-4)


def test_metadata_layout_of_a_mixed_step():
    from engine.forward_context import build_attention_metadata

    meta = build_attention_metadata([3, 1, 2], [0, 20, 4], [(4,), (1, 2), (7,)], 16)
    assert meta.positions.tolist() == [0, 1, 2, 20, 4, 5]
    assert meta.slot_mapping.tolist() == [64, 65, 66, 36, 116, 117]
    assert meta.logits_index.tolist() == [2, 3, 5]
    assert [(p.start, p.end, p.context_len) for p in meta.prefills] == [(0, 3, 0), (4, 6, 4)]
    assert meta.prefills[1].prefix_slots.tolist() == [112, 113, 114, 115]
    assert meta.decode.token_index.tolist() == [3]
    assert meta.decode.block_table.tolist() == [[1, 2]]
    assert meta.decode.seq_lens.tolist() == [21]
    assert meta.decode.padded_slots(16).slots[0, :21].tolist() == list(range(16, 37))
    with pytest.raises(ValueError, match="does not fit"):
        build_attention_metadata([5], [30], [(0, 1)], 16)


def test_bfloat16_runs_close_to_float32(tiny_ckpt):
    step = [SeqStep("a", tuple(range(100, 140)), 0, (0, 1, 2))]
    ref = ModelRunner(tiny_ckpt, num_kv_blocks=4, block_size=BLOCK).execute(step)[0]
    low = ModelRunner(tiny_ckpt, num_kv_blocks=4, block_size=BLOCK, dtype=torch.bfloat16)
    assert low.kv_cache.k_caches[0].dtype == torch.bfloat16
    got = low.execute(step)[0]
    assert got.dtype == torch.float32
    assert torch.corrcoef(torch.stack((got, ref)))[0, 1] > 0.999


def test_request_past_max_position_embeddings_is_refused(runner):
    limit = runner.model_config.max_position_embeddings
    with pytest.raises(ValueError, match="max_position_embeddings is 4096"):
        runner.execute([SeqStep("long", (1, 2), limit - 1, tuple(range(64)))])


def test_block_ids_outside_the_cache_are_refused(runner):
    with pytest.raises(ValueError, match="block ids \\[64\\] outside this KV cache's 64 blocks"):
        runner.execute([SeqStep("x", (1, 2, 3), 0, (64,))])


def test_block_table_cache_reuses_a_table_until_it_changes():
    from engine.forward_context import BlockTableCache

    cache = BlockTableCache(num_blocks=8)
    a, b = cache.tensors(["a", "b"], [(1, 2), (3,)])
    assert a.tolist() == [1, 2] and b.tolist() == [3]
    again = cache.tensors(["b", "a"], [(3,), tuple([1, 2])])  # an equal, fresh tuple
    assert again[0] is b and again[1] is a
    reused_id = cache.tensors(["a"], [(4, 5)])[0]  # same id, other blocks: a new tensor
    assert reused_id.tolist() == [4, 5]
    assert cache.tensors(["b"], [(3,)])[0] is not b  # "b" was absent from the last step
    with pytest.raises(ValueError, match="block ids \\[8, -1\\] outside this KV cache's 8"):
        cache.tensors(["c"], [(0, 8, -1)])


def test_a_reused_request_id_writes_and_reads_its_new_blocks(runner):
    """The runner's cached block table of an id is not used once the id names other blocks:
    the same prompt under a reused id lands in its new blocks, as under a fresh id."""
    prompt = tuple(range(100, 120))
    runner.execute([SeqStep("r", prompt, 0, (0, 1))])
    runner.execute([SeqStep("r", (7,), len(prompt), (0, 1))])
    runner.execute([SeqStep("r", prompt, 0, (2, 3))])  # the next step: "r" is still cached
    runner.execute([SeqStep("s", prompt, 0, (4, 5))])
    for caches in (runner.kv_cache.k_caches, runner.kv_cache.v_caches):
        # NOTE: the prompt's rows only: the blocks' other rows hold what earlier tests left
        rows = [caches[0][list(blocks)].flatten(0, 1)[:len(prompt)]
                for blocks in ((2, 3), (4, 5))]
        assert torch.equal(*rows)
    decode_fresh = runner.execute([SeqStep("s", (7,), len(prompt), (4, 5))])
    decode_reused = runner.execute([SeqStep("r", (7,), len(prompt), (2, 3))])
    assert torch.equal(decode_fresh, decode_reused)
