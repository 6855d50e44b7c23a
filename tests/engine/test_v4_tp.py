"""DeepSeek-V4 under TP (engine/v4/tp.py): tp 2 (the tiny checkpoint with ``o_groups`` 4: two
whole output groups a rank; 32 greedy tokens) and tp 4 (the tiny checkpoint, 2 groups: each
shared by two ranks; 8 tokens, four processes on a shared machine) give tp 1's logits within
fp32 tolerance at every step, the same greedy tokens, and the same (whole) V4 cache on every
rank; tp 1 equals transformers (tests/engine/test_v4_runner.py,
test_v4_hf_parity.py). Ranks are forked gloo processes (tests/rank_processes.py)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.multiprocessing as mp

from engine.parallel import TPGroup
from engine.runner import SeqStep
from engine.v4.config import V4Config
from engine.v4.runner import V4Runner
from engine.v4.tp import V4Shards, check_tp
from tests.ports import free_port
from tests.rank_processes import START_METHOD

TOL = 1e-4
NEW = {2: 32, 4: 8}  # greedy tokens by tp size


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 129000, (n,), generator=torch.Generator().manual_seed(seed))
                 .tolist())


def _scenario(runner: V4Runner, new: int) -> tuple[torch.Tensor, list[int], list]:
    """``a`` (21 tokens) in chunks of 8, ``b`` (6) joining its last chunk, then ``new`` greedy
    tokens of both, batched: (every step's logits ``[rows, vocab]``, a's greedy tokens, a's
    exported cache)."""
    a, b = _prompt(21, 0), _prompt(6, 1)
    rows = [runner.execute([SeqStep("a", a[:8], 0, (0,))]),
            runner.execute([SeqStep("a", a[8:16], 8, (0,))])]
    last = runner.execute([SeqStep("a", a[16:], 16, (0,)), SeqStep("b", b, 0, (1,))])
    rows.append(last)
    toks = [int(t) for t in last.argmax(-1)]
    greedy = [toks[0]]
    for i in range(new - 1):
        out = runner.execute([SeqStep("a", (toks[0],), 21 + i, (0,)),
                              SeqStep("b", (toks[1],), 6 + i, (1,))])
        rows.append(out)
        toks = [int(t) for t in out.argmax(-1)]
        greedy.append(toks[0])
    return torch.cat(rows), greedy, runner.export_request("a")


def _rank_main(rank: int, size: int, port: int, ckpt: str, out_dir: str) -> None:
    from engine.parallel import init_tp_group  # noqa: PLC0415

    torch.set_num_threads(1)
    tp = init_tp_group(rank, size, "127.0.0.1", port, "gloo", timeout_s=60)
    try:
        runner = V4Runner(ckpt, num_kv_blocks=16, block_size=16, tp=tp)
        attn = runner.model.model.layers[0].self_attn
        heads = runner.model.config.num_attention_heads
        assert (attn.num_heads, attn.sinks.shape[0]) == (heads // size, heads // size)
        torch.save(_scenario(runner, NEW[size]), f"{out_dir}/tp{size}_rank{rank}.pt")
    finally:
        tp.destroy()


def _run_ranks(size: int, ckpt: str, out_dir: str) -> None:
    ctx = mp.start_processes(_rank_main, args=(size, free_port(), ckpt, out_dir), nprocs=size,
                             join=False, start_method=START_METHOD)
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"tp {size} ranks did not finish within 120 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture(scope="module")
def groups4_ckpt(tiny_v4_ckpt, tmp_path_factory):
    """The tiny checkpoint with o_groups 4 (one head a group): the grouped output
    projection's two weights redrawn at their new shapes, the rest kept."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    out = tmp_path_factory.mktemp("v4g4")
    raw = json.loads((tiny_v4_ckpt / "config.json").read_text()) | {"o_groups": 4}
    (out / "config.json").write_text(json.dumps(raw))
    state, gen = load_file(str(tiny_v4_ckpt / "model.safetensors")), torch.Generator()
    gen.manual_seed(6)
    heads_dim, r_o = raw["num_attention_heads"] * raw["head_dim"], raw["o_lora_rank"]
    for i in range(raw["num_hidden_layers"]):
        state[f"layers.{i}.attn.wo_a.weight"] = torch.randn(
            4 * r_o, heads_dim // 4, generator=gen) / (heads_dim // 4) ** 0.5
        state[f"layers.{i}.attn.wo_b.weight"] = torch.randn(
            raw["hidden_size"], 4 * r_o, generator=gen) / (4 * r_o) ** 0.5
    save_file(state, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("size", [2, 4], ids=["tp2", "tp4"])
def test_tp_equals_tp1(size, tiny_v4_ckpt, groups4_ckpt, tmp_path):
    ckpt = str(groups4_ckpt if size == 2 else tiny_v4_ckpt)
    _run_ranks(size, ckpt, str(tmp_path))
    torch.set_num_threads(1)
    ref_logits, ref_greedy, ref_cache = _scenario(
        V4Runner(ckpt, num_kv_blocks=16, block_size=16), NEW[size])
    for rank in range(size):
        logits, greedy, cache = torch.load(tmp_path / f"tp{size}_rank{rank}.pt")
        diff = (logits - ref_logits).abs().max().item()
        assert diff <= TOL, f"rank {rank}: max |logit diff| {diff}"
        assert greedy == ref_greedy, f"rank {rank}"
        for layer, (got, want) in enumerate(zip(cache, ref_cache, strict=True)):
            assert got.keys() == want.keys(), layer
            for name in want:
                assert torch.allclose(got[name], want[name], atol=TOL), (rank, layer, name)


def test_tp_sizes_the_split_keeps_whole_are_checked(tiny_v4_ckpt):
    """tp must divide the heads (4), moe_intermediate_size and vocab, and divide or be a
    multiple of o_groups (2)."""
    config = V4Config.from_dict(json.loads((tiny_v4_ckpt / "config.json").read_text()))
    for tp in (1, 2, 4):
        check_tp(config, tp)
    with pytest.raises(ValueError, match=r"tp=3 does not divide DeepSeek-V4's "
                                         r"num_attention_heads=4"):
        check_tp(config, 3)
    with pytest.raises(ValueError, match=r"tp=8 does not divide"):
        V4Runner(tiny_v4_ckpt, num_kv_blocks=4, block_size=4, tp=TPGroup(rank=0, size=8))
    odd = V4Config(**{**config.__dict__, "o_groups": 3, "num_attention_heads": 6})
    with pytest.raises(ValueError, match="tp=2 and DeepSeek-V4's o_groups=3"):
        check_tp(odd, 2)


def test_rank_parts_tile_the_whole_tensors():
    """Rank parts put together give back the whole tensor: gate_up splits each half; the
    grouped output projection by whole groups (tp <= o_groups) or each group's o_a columns
    over tp / o_groups ranks, o_b's group columns shared by them."""
    gate_up = torch.arange(2 * 8 * 6).view(2, 8, 6)  # [E, 2I, h], I = 4
    name = "model.layers.0.mlp.experts.gate_up_proj"
    parts = [V4Shards(2, 2, r).local_part(name, gate_up) for r in range(2)]
    assert torch.equal(parts[0], torch.cat([gate_up[:, 0:2], gate_up[:, 4:6]], dim=1))
    assert torch.equal(parts[1], torch.cat([gate_up[:, 2:4], gate_up[:, 6:8]], dim=1))
    o_a, o_b = torch.arange(4 * 6).view(4, 6), torch.arange(3 * 4).view(3, 4)  # g 2, r_o 2
    o_a_name, o_b_name = (f"model.layers.3.self_attn.{p}_proj.weight" for p in ("o_a", "o_b"))
    whole = [V4Shards(2, 2, r) for r in range(2)]
    assert torch.equal(torch.cat([s.local_part(o_a_name, o_a) for s in whole]), o_a)
    assert torch.equal(torch.cat([s.local_part(o_b_name, o_b) for s in whole], 1), o_b)
    split = [V4Shards(2, 4, r) for r in range(4)]  # NOTE: group 0 on ranks 0, 1
    a = [s.local_part(o_a_name, o_a) for s in split]
    assert torch.equal(torch.cat([torch.cat(a[:2], 1), torch.cat(a[2:], 1)]), o_a)
    b = [s.local_part(o_b_name, o_b) for s in split]
    assert torch.equal(b[0], b[1]) and torch.equal(torch.cat([b[0], b[2]], 1), o_b)
    assert split[1].full_shape(o_a_name, tuple(a[1].shape)) == tuple(o_a.shape)
    assert split[3].full_shape(o_b_name, tuple(b[3].shape)) == tuple(o_b.shape)
    kv = torch.arange(6)
    assert split[1].local_part("model.layers.0.self_attn.kv_proj.weight", kv) is kv
