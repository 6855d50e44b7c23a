"""DeepSeek-V4 with ``fp8_storage: fp8`` (engine/v4/stored.py): the FP8 linears, the FP8 or FP4
routed experts stay as stored, and the logits equal the dequantize path on the same checkpoint,
bit for bit in fp32 (the same float32 dequantization, only later), at tp 1, on TP ranks of 2
and EP ranks of 2 (forked gloo processes, tests/rank_processes.py). Checkpoints: the tiny one
of ``orch model init-tiny --arch deepseek_v4`` with the linears the release stores FP8 (and the
routed experts FP8, or MXFP4 as the release) quantized in 16 x 16 blocks (tiny dims; every TP
2 piece whole blocks) or 16 x 24 ones (partial blocks; tp 2 cuts some)."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import nn

from engine.model_config import CheckpointError
from engine.parallel import EPGroup, TPGroup
from engine.quant.fp8_block import FP8_MAX, Fp8BlockExperts, Fp8BlockLinear, quantize_block
from engine.quant.mxfp4 import Mxfp4Experts
from engine.v4.loader import load_v4
from engine.v4.stored import RELEASE_FP8
from tests.engine.test_v4_fp4 import _pack_mxfp4
from tests.ports import free_port
from tests.rank_processes import START_METHOD

LINEAR = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                    r"|ffn\.shared_experts\.w[123])\.weight")
ROUTED = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")


def _ue8m0(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 blocks with power-of-two scales stored float8_e8m0fnu, as the release writes them
    (``scale_fmt: ue8m0``): the block's amax over 448 rounded up to a power of two."""
    _, amax_scale = quantize_block(w, block)  # amax / 448 per block
    scale = torch.exp2(torch.ceil(torch.log2(amax_scale)))
    rows = torch.arange(w.shape[0]) // block[0]
    cols = torch.arange(w.shape[1]) // block[1]
    q = (w / scale[rows][:, cols]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def _write(tiny, out, block: tuple[int, int], experts: str) -> None:
    """The tiny checkpoint with :data:`LINEAR` FP8 in ``block`` blocks (alternately V3 / HF's
    float32 ``weight_scale_inv`` and the release's ``.scale`` e8m0) and the routed experts
    ``experts`` ("fp8" as the linears, "fp4" packed MXFP4 with e8m0 scales per 32)."""
    raw = json.loads((tiny / "config.json").read_text())
    quant, count = {}, 0
    for name, t in load_file(str(tiny / "model.safetensors")).items():
        if ROUTED.fullmatch(name) and experts == "fp4":
            q, scale = _pack_mxfp4(t)
            quant[name], quant[name.removesuffix("weight") + "scale"] = q, scale
        elif (LINEAR.fullmatch(name) or ROUTED.fullmatch(name)) and count % 2:
            q, scale = _ue8m0(t, block)
            quant[name], quant[name.removesuffix("weight") + "scale"] = q, scale
            count += 1
        elif LINEAR.fullmatch(name) or ROUTED.fullmatch(name):
            q, scale = quantize_block(t, block)
            quant[name], quant[name + "_scale_inv"] = q, scale
            count += 1
        else:
            quant[name] = t
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": list(block)}
    out.mkdir()
    (out / "config.json").write_text(json.dumps(
        raw | {"quantization_config": qc} | ({"expert_dtype": "fp4"} if experts == "fp4"
                                             else {})))
    save_file(quant, str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def ckpts(tiny_v4_ckpt, tmp_path_factory):
    """{"fp8": FP8 experts, 16 x 16; "fp4": MXFP4 experts, 16 x 16; "partial": FP8 experts,
    16 x 24 blocks}."""
    root = tmp_path_factory.mktemp("v4stored")
    out = {}
    for kind, block, experts in (("fp8", (16, 16), "fp8"), ("fp4", (16, 16), "fp4"),
                                 ("partial", (16, 24), "fp8")):
        _write(tiny_v4_ckpt, root / kind, block, experts)
        out[kind] = root / kind
    return out


def _ids(seed: int = 3, n: int = 23) -> torch.Tensor:
    return torch.randint(0, 129000, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["fp8", "fp4", "partial"])
def test_kept_storage_gives_the_dequantized_logits(ckpts, kind):
    """tp 1, fp32: the release's linears are :class:`Fp8BlockLinear` (e4m3 + float32 block
    scales), the compressors / indexer weights_proj / router / head stay float, the routed
    experts FP8 or packed MXFP4 stacks; the logits of a 23-token prompt and of a decode token
    after it equal the dequantize path's exactly. In bf16 too."""
    ckpt = ckpts[kind]
    kept = load_v4(ckpt, fp8_storage="fp8")
    fp8 = {n for n, m in kept.named_modules() if isinstance(m, Fp8BlockLinear)}
    assert fp8 == {n.removesuffix(".weight") for n in kept.state_dict()
                   if RELEASE_FP8.fullmatch(n)}
    assert len(fp8) == 4 * (5 + 3) + 2  # 5 attention + 3 shared a layer, 2 CSA indexers
    assert isinstance(kept.get_submodule("model.layers.1.self_attn.compressor.kv_proj"),
                      nn.Linear)
    stack = Mxfp4Experts if kind == "fp4" else Fp8BlockExperts
    for layer in kept.model.layers:
        assert isinstance(layer.mlp.experts.gate_up_proj, stack)
        assert layer.self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    for dtype in (torch.float32, torch.bfloat16):
        plain = load_v4(ckpt, dtype)
        ours = kept if dtype == torch.float32 else load_v4(ckpt, dtype, fp8_storage="fp8")
        with torch.no_grad():
            caches = plain.new_cache(), ours.new_cache()
            for ids in (_ids(), _ids(4, 1)):
                want, got = plain(ids, caches[0]), ours(ids, caches[1])
                assert torch.equal(got, want), (dtype, (got - want).abs().max().item())


@pytest.mark.parametrize(("kind", "group"), [
    ("fp8", {"tp": TPGroup(rank=1, size=2)}), ("fp8", {"ep": EPGroup(rank=1, size=4)}),
    ("fp4", {"ep": EPGroup(rank=1, size=4)})], ids=["fp8-tp2", "fp8-ep4", "fp4-ep4"])
def test_a_rank_keeps_its_part_of_weights_and_scales(ckpts, kind, group):
    """TP rank 1 of 2 (FP8 experts split by intermediate) and EP rank 1 of 4 (its experts
    whole; FP8 or MXFP4) load without collectives: every kept weight,
    dequantized, is exactly the dequantize path's parameter (the same rows and columns: the
    weight's and its scale grid's parts line up), and it holds fewer bytes."""
    plain = load_v4(ckpts[kind], **group)
    kept = load_v4(ckpts[kind], fp8_storage="fp8", **group)
    want = plain.state_dict()
    checked = 0
    for name, module in kept.named_modules():
        if isinstance(module, Fp8BlockLinear):
            assert torch.equal(module.dense(torch.float32), want[f"{name}.weight"]), name
            checked += 1
        elif isinstance(module, Fp8BlockExperts | Mxfp4Experts):
            for e in range(module.weight.shape[0]):
                assert torch.equal(module[e], want[name][e]), (name, e)
            checked += 1
    assert checked == 4 * (5 + 3 + 2) + 2  # per layer 5 attention + 3 shared + 2 stacks, 2 CSA
    size = {m: sum(t.numel() * t.element_size() for t in m.state_dict().values())
            for m in (plain, kept)}
    assert size[kept] < size[plain]


def test_a_tp_split_that_cuts_a_block_is_refused(ckpts):
    """16 x 24 blocks: tp 1 keeps them (partial last blocks are fine whole); tp 2 cuts the
    grouped o_b_proj (2 groups of 16 inputs, one a rank: not whole 24-wide blocks), and MXFP4
    experts' down_proj (16 inputs a rank, not a whole 32-wide e8m0 group): refused naming the
    tensor, the tp and the fix; dequantize loads both."""
    with pytest.raises(CheckpointError, match=r"experts\.down_proj: tp=2 cuts it into pieces "
                                              r"of 16 along dim 2, not whole 32-wide"):
        load_v4(ckpts["fp4"], tp=TPGroup(rank=1, size=2), fp8_storage="fp8")
    load_v4(ckpts["fp4"], tp=TPGroup(rank=1, size=2))
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.o_b_proj\.weight: tp=2 cuts "
                                              r"it into pieces of 16 along dim 1, not whole "
                                              r"24-wide.*fp8_storage: dequantize"):
        load_v4(ckpts["partial"], tp=TPGroup(rank=0, size=2), fp8_storage="fp8")
    load_v4(ckpts["partial"], tp=TPGroup(rank=0, size=2))
    with pytest.raises(ValueError, match="fp8_storage 'fp4'"):
        load_v4(ckpts["fp8"], fp8_storage="fp4")


def test_an_unquantized_checkpoint_loads_float_under_either_storage(tiny_v4_ckpt):
    """No quantization_config: ``fp8_storage: fp8`` keeps nothing quantized (as V3's)."""
    kept, plain = load_v4(tiny_v4_ckpt, fp8_storage="fp8"), load_v4(tiny_v4_ckpt)
    assert not any(isinstance(m, Fp8BlockLinear | Fp8BlockExperts | Mxfp4Experts)
                   for m in kept.modules())
    for name, t in kept.state_dict().items():
        assert torch.equal(t, plain.state_dict()[name]), name


def _rank_main(rank: int, mode: str, port: int, ckpt: str, out_dir: str) -> None:
    from engine.parallel import init_ep_group, init_tp_group  # noqa: PLC0415

    torch.set_num_threads(1)
    init = init_tp_group if mode == "tp" else init_ep_group
    group = init(rank, 2, "127.0.0.1", port, "gloo", timeout_s=60)
    try:
        models = [load_v4(ckpt, fp8_storage=s, **{mode: group}) for s in ("dequantize", "fp8")]
        ids = _ids(3 if mode == "tp" else 3 + rank)  # NOTE: EP ranks are DP ranks: own prompts
        with torch.no_grad():
            logits = [m(ids, m.new_cache()) for m in models]
        torch.save(logits, f"{out_dir}/{mode}{rank}.pt")
    finally:
        group.destroy()


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_tp2_and_ep2_ranks_give_the_dequantized_logits(ckpts, mode, tmp_path):
    """Two gloo ranks: tp 2 (FP8 experts split by intermediate) or ep 2 over dp 2 x tp 1
    (MXFP4 experts whole, each rank its own prompt): each rank's logits with kept storage
    equal its dequantize-path logits exactly."""
    ckpt = ckpts["fp8" if mode == "tp" else "fp4"]
    ctx = mp.start_processes(_rank_main, args=(mode, free_port(), str(ckpt),
                                               str(tmp_path)),
                             nprocs=2, join=False, start_method=START_METHOD)
    deadline = time.monotonic() + 180
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{mode} 2 ranks did not finish within 180 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    for rank in range(2):
        plain, kept = torch.load(tmp_path / f"{mode}{rank}.pt")
        assert torch.equal(kept, plain), (rank, (kept - plain).abs().max().item())


@pytest.mark.parametrize(("kind", "dp", "tp", "ep"), [
    ("fp8", 1, 1, False), ("fp4", 1, 1, False), ("fp8", 1, 2, False), ("fp8", 2, 2, True),
    ("fp4", 4, 1, True), ("partial", 1, 1, False)])
def test_memory_plan_equals_the_kept_engine_bytes(ckpts, kind, dp, tp, ep):
    """orchestrator/config/memory_plan_v4.py with ``fp8_storage: fp8`` on the checkpoint's
    config.json: its weight rows' bytes equal the bytes of the rank's loaded model (every
    state-dict tensor: e4m3 weights, float32 block scales, packed FP4 + e8m0, fp32 rest),
    at tp 1 (16 x 16 and partial 16 x 24 grids), TP rank 1 of 2, and EP ranks (dp 2 x tp 2,
    dp 4): the FP8 rows at 1 byte, the scales row, FP4 at 0.53, the compressors at dtype."""
    from orchestrator.config.role_layout import RoleLayout  # noqa: PLC0415 (planner side)
    from orchestrator.config.memory_plan_v4 import V4Precision, plan_role_v4  # noqa: PLC0415

    from engine.v4.config import V4Config  # noqa: PLC0415

    raw = json.loads((ckpts[kind] / "config.json").read_text())
    groups = {"tp": TPGroup(rank=1, size=tp)} if tp > 1 else {}
    if ep:
        groups["ep"] = EPGroup(rank=dp * tp - 1, size=dp * tp)
    model = load_v4(ckpts[kind], fp8_storage="fp8", **groups)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    layout = RoleLayout(role="decode", dp=dp, tp=tp, ep=ep, num_kv_blocks=4, block_size=16,
                        step_tokens=4, max_num_seqs=1, max_model_len=64)
    precision = V4Precision.for_checkpoint(raw, "float32", "fp8")
    plan = plan_role_v4(V4Config.from_dict(raw), layout, precision)
    assert plan.bytes_of("weights") == held
    rows = {r.kind: r for r in plan.rows}
    assert rows["FP8 block scales"].bytes_per_element == 4 and rows["attention"].bytes == \
        rows["attention"].elements


def test_the_serving_runner_keeps_the_storage_it_is_given(ckpts):
    """``build_runner(..., fp8_storage=...)`` as a rank calls it (rank/rank.py): the V4 runner
    over paged caches holds the kept modules and gives the dequantize runner's logits for a
    prefill chunk, the rest of the prompt, and three greedy decode steps."""
    from engine.runner import SeqStep, build_runner  # noqa: PLC0415

    runners = [build_runner(ckpts["fp4"], num_kv_blocks=8, block_size=16, fp8_storage=s)
               for s in ("dequantize", "fp8")]
    assert isinstance(runners[1].model.model.layers[0].mlp.experts.down_proj, Mxfp4Experts)
    assert isinstance(runners[0].model.model.layers[0].mlp.experts.down_proj, nn.Parameter)
    prompt = tuple(_ids(5, 19).tolist())
    steps = [(prompt[:8], 0), (prompt[8:], 8)]
    outs = [[], []]
    for i, runner in enumerate(runners):
        for tokens, start in steps:
            outs[i].append(runner.execute([SeqStep("r", tokens, start, (0,))]))
        for n in range(3):
            token = int(outs[i][-1][0].argmax())
            outs[i].append(runner.execute([SeqStep("r", (token,), len(prompt) + n, (0,))]))
    for want, got in zip(*outs, strict=True):
        assert torch.equal(got, want)
