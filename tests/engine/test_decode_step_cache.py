"""The decode-only metadata cache (engine/decode_step_cache.py) gives what
build_attention_metadata builds from scratch, step after step, as sequences cross blocks,
jump (MTP), and the batch changes."""

from __future__ import annotations

import random

import pytest
import torch

from engine.decode_step_cache import DecodeStepCache
from engine.forward_context import build_attention_metadata


def assert_same(fast, ref) -> None:
    for name in ("positions", "slot_mapping", "logits_index"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    assert fast.prefills == ref.prefills == ()
    for name in ("token_index", "block_table", "seq_lens"):
        a, b = getattr(fast.decode, name), getattr(ref.decode, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_steps_equal_the_general_build():
    rng = random.Random(0)
    bs = 4
    tables = {f"r{i}": tuple(rng.sample(range(200), 20)) for i in range(6)}
    ctx = {rid: rng.randrange(1, 20) for rid in tables}
    cache = DecodeStepCache(bs, "cpu")
    batch = ["r0", "r1", "r2"]
    for step in range(40):
        if step == 15:
            batch = ["r0", "r2", "r3", "r4"]  # one left, two joined
        if step == 30:
            ctx["r2"] += 7  # several tokens at once (MTP drafts kept)
        lens = [ctx[r] for r in batch]
        fast = cache.build(batch, lens, [tables[r] for r in batch])
        ref = build_attention_metadata([1] * len(batch), lens, [tables[r] for r in batch], bs)
        assert_same(fast, ref)
        for r in batch:
            ctx[r] += 1
    # NOTE: rebuilt only for a new batch, a wider table or a jump; otherwise written in place
    assert 3 <= cache.rebuilds < 15


def test_a_table_too_short_is_refused():
    cache = DecodeStepCache(4, "cpu")
    with pytest.raises(ValueError, match="does not fit 2 blocks"):
        cache.build(["a"], [8], [(0, 1)])
