"""A long DeepSeek-V4 prompt's KV through PD shipped at the end of its prefill (before) against
chunk by chunk (after): records, bytes per record, bytes left to send once the last chunk's
forward ends, and the measured KV tail (docs/kv_transfer.md "DeepSeek-V4: staged per-layer
state").

Computed (always; from the specs, engine/v4/row_layout.py): a P1 -> D1 plan sends one record per
row range a chunk makes final (``chunk_rows``: each layer its own rows); "end" is the former
policy, every row after the last chunk (one record per kind: ``chunk_rows(n, 0, n)``). ``--config`` names a V4 config.json (default: transformers'
``DeepseekV4Config``, 43 layers), ``--bytes-per-element`` 2 (bf16).

Measured (``--measure``): an in-process prefill rank and decode rank (no Ray; the roles, the
scheduler and the real connectors over gloo / the same-node segment) on a random checkpoint with
V4's KV widths (head_dim 512, index_head_dim 128, window 128, HCA ratio 128; 8 layers, small
hidden size and experts, fp32), one prompt of ``--tokens`` in chunks of ``--chunk``, each mode
``--reps`` times, alternating. Per request: ``kv_tail_s`` (decode's own figure: end of the last
chunk's forward to the last row's arrival) and the time from that forward's end to the end of
decode's rebuild of the request's cache (it joins the batch then: "admit"). Medians, and the
median of the paired ratios end / stream. "end" is run by giving the prefill role a
``chunk_rows`` that makes every row final at the last chunk (``chunk_rows(n, 0, n)``), the
policy the chunk-by-chunk one replaced, on the same ranks and connectors.

    PYTHONPATH=$PWD python benchmarks/v4_kv_stream.py --tokens 32768 --chunk 4096
    PYTHONPATH=$PWD python benchmarks/v4_kv_stream.py --measure --tokens 8192 --chunk 1024 --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from engine.v4.config import V4Config
from engine.v4.row_layout import RowRange, chunk_rows, staged_rows
from engine.v4.staging import kind_widths

MIB = 2 ** 20


def v4_config(path: str | None) -> V4Config:
    """The V4 config of ``path`` (a config.json), else transformers' default one."""
    if path:
        return V4Config.from_dict(json.loads(Path(path).read_text()))
    from transformers import DeepseekV4Config  # noqa: PLC0415 (default shapes only)

    return V4Config.from_dict(DeepseekV4Config().to_dict())


def at_end(config: V4Config, n: int, start: int, end: int) -> tuple[RowRange, ...]:
    """The former policy: nothing before the last chunk, then every row (a range per kind)."""
    return chunk_rows(config, n, 0, n) if end == n else ()


def records(config: V4Config, n: int, chunk: int, elem: int, streamed: bool
            ) -> list[tuple[int, int]]:
    """(chunk end, bytes) of every record a P1 -> D1 pair carries, in send order."""
    widths = kind_widths(config)
    out = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        ranges = chunk_rows(config, n, start, end) if streamed else at_end(config, n, start, end)
        out += [(end, (r.end - r.start) * sum(widths[config.layer_types[i]] for i in r.layers)
                 * elem) for r in ranges]
    return out


def print_computed(config: V4Config, tokens: list[int], chunk: int, elem: int) -> None:
    print(f"V4: {config.num_hidden_layers} layers, kind widths {kind_widths(config)}, window "
          f"{config.sliding_window}; chunks of {chunk}; {elem} B per element; P1 -> D1\n")
    print("| prompt tokens | policy | records | before last chunk | per record min / median /"
          " max | after the last forward | total |\n|---|---|---|---|---|---|---|")
    for n in tokens:
        for name, streamed in (("end", False), ("stream", True)):
            recs = records(config, n, chunk, elem, streamed)
            sizes = [b for _, b in recs]
            tail = sum(b for end, b in recs if end == n)
            early = sum(1 for end, _ in recs if end < n)
            print(f"| {n:,} | {name} | {len(recs)} | {early} | {min(sizes) / MIB:,.2f} / "
                  f"{statistics.median(sizes) / MIB:,.2f} / {max(sizes) / MIB:,.2f} MiB | "
                  f"{tail / MIB:,.1f} MiB | {sum(sizes) / MIB:,.1f} MiB |")


# ---- measured ------------------------------------------------------------------------------

def bench_checkpoint(out: Path, layers: int, max_tokens: int) -> Path:
    """A random V4 checkpoint with V4's KV widths and small everything else (module
    docstring): the tiny one with its config.json and weights replaced."""
    from safetensors.torch import save_file  # noqa: PLC0415

    from orchestrator.tiny_model_v4 import (tiny_v4_config_dict,  # noqa: PLC0415
                                            tiny_v4_state_dict, write_tiny_v4_checkpoint)

    write_tiny_v4_checkpoint(out, seed=1)
    raw = tiny_v4_config_dict()
    ratios = [0] + [4 if i % 2 else 128 for i in range(1, layers)] + [0]  # + MTP layer
    raw.update(num_hidden_layers=layers, head_dim=512, qk_rope_head_dim=64,
               index_head_dim=128, sliding_window=128, compress_ratios=ratios,
               compress_rate_hca=128, max_position_embeddings=max_tokens + 64)
    state = tiny_v4_state_dict(V4Config.from_dict(raw), seed=1)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def start_rank(role_cls, ckpt: Path, role: str, tokens: int, chunk: int):
    """An in-process V4 rank of ``role`` (tests/workers/test_v4_pd.py's set-up) whose pools
    hold one request of ``tokens`` prompt tokens."""
    from kv_transfer.config import TransferConfig  # noqa: PLC0415
    from rank.config import InstanceConfig, SchedulerConfig  # noqa: PLC0415
    from rank.rank import Rank  # noqa: PLC0415

    block = 64
    config = V4Config.from_dict(json.loads((ckpt / "config.json").read_text()))
    staging = -(-staged_rows(config, tokens) // block) + 1
    scheduler = SchedulerConfig(block_size=block, num_kv_blocks=tokens // block + 8,
                                chunk_size=chunk, max_num_batched_tokens=chunk,
                                max_num_seqs=1, prefix_cache=False, staging_blocks=staging)
    transfer = TransferConfig(connect_timeout_s=30, header_timeout_s=30,
                              payload_timeout_s=60, completion_timeout_s=600)
    rank = Rank(InstanceConfig(name=f"{role}-0", role=role, checkpoint_dir=str(ckpt),
                               scheduler=scheduler, transfer=transfer), 0, role_cls)
    rank.start_alone()
    return rank


def one_request(prefill, decode, rid: str, prompt: tuple[int, ...]) -> tuple[float, float]:
    """Serve ``prompt`` (2 output tokens); (kv_tail_s, last forward end -> decode admitted)."""
    from engine.request import RequestSpec  # noqa: PLC0415
    from engine.sampling_params import SamplingParams  # noqa: PLC0415
    from rank.messages import Admit, Prefill, Reserve  # noqa: PLC0415

    marks: dict[str, float] = {}
    queue, admit = prefill.role.sends.queue, decode.runner.admit_staged

    def timed_queue(transfers, output=None):
        if any(t.last for t in transfers or ()):
            marks["forward_end"] = time.time()
        queue(transfers, output)

    def timed_admit(*args, **kwargs):
        admit(*args, **kwargs)
        marks["admitted"] = time.time()

    prefill.role.sends.queue, decode.runner.admit_staged = timed_queue, timed_admit
    try:
        spec = RequestSpec(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        prefill.request(Prefill(spec, decode.request(Reserve(spec, 1))))
        first = _events(prefill, rid, lambda e: True)[0]
        decode.request(Admit(rid, first.token_ids[0]))
        end = _events(decode, rid, lambda e: e.finish_reason is not None)[-1]
        assert end.error is None, end
    finally:
        prefill.role.sends.queue, decode.runner.admit_staged = queue, admit
    return decode.role.kv_tail.last_s, marks["admitted"] - marks["forward_end"]


def _events(rank, rid: str, until, timeout_s: float = 600.0) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in rank.poll(0.1):
            if ev.request_id == rid:
                got.append(ev)
                if until(ev):
                    return got
    raise TimeoutError(f"{rid}: no final event within {timeout_s} s")


def measure(tokens: int, chunk: int, reps: int, layers: int) -> None:
    import torch  # noqa: PLC0415

    from decode_worker.role import DecodeRole  # noqa: PLC0415
    from prefill_worker.role import PrefillRole  # noqa: PLC0415

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = bench_checkpoint(Path(tmp) / "v4", layers, tokens)
        config = V4Config.from_dict(json.loads((ckpt / "config.json").read_text()))
        prefill = start_rank(PrefillRole, ckpt, "prefill", tokens, chunk)
        decode = start_rank(DecodeRole, ckpt, "decode", tokens, chunk)
        streamed = prefill.role.chunk_rows
        policies = {"end": lambda n, s, e: at_end(config, n, s, e), "stream": streamed}
        got: dict[str, list[tuple[float, float]]] = {name: [] for name in policies}
        try:
            for rep in range(reps):
                for name, rows in policies.items():
                    prefill.role.chunk_rows = rows
                    prompt = tuple(torch.randint(0, 129000, (tokens,), generator=torch
                                                 .Generator().manual_seed(rep)).tolist())
                    got[name].append(one_request(prefill, decode, f"{name}{rep}", prompt))
                    print(f"rep {rep} {name}: kv_tail {got[name][-1][0] * 1e3:.1f} ms, "
                          f"forward end -> admitted {got[name][-1][1] * 1e3:.1f} ms")
        finally:
            prefill.shutdown()
            decode.shutdown()
    recs = {name: records(config, tokens, chunk, 4, name == "stream") for name in policies}
    print(f"\n{layers} layers, {tokens:,} tokens in chunks of {chunk}, fp32, {reps} reps each, "
          "alternating\n")
    print("| policy | records | bytes after the last forward | kv_tail_s median | forward end"
          " -> admitted median |\n|---|---|---|---|---|")
    for name, vals in got.items():
        tail = sum(b for end, b in recs[name] if end == tokens)
        print(f"| {name} | {len(recs[name])} | {tail / MIB:,.2f} MiB | "
              f"{statistics.median(v[0] for v in vals) * 1e3:.1f} ms | "
              f"{statistics.median(v[1] for v in vals) * 1e3:.1f} ms |")
    for i, what in enumerate(("kv_tail_s", "forward end -> admitted")):
        ratios = [e[i] / s[i] for e, s in zip(got["end"], got["stream"], strict=True) if s[i]]
        if ratios:
            print(f"paired median end / stream, {what}: {statistics.median(ratios):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--config", help="a DeepSeek-V4 config.json (default: transformers')")
    ap.add_argument("--bytes-per-element", type=int, default=2, help="2: bf16")
    ap.add_argument("--measure", action="store_true", help="also serve one prompt per "
                    "--tokens value on in-process ranks, both policies")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8, help="--measure's checkpoint")
    args = ap.parse_args()
    print_computed(v4_config(args.config), args.tokens, args.chunk, args.bytes_per_element)
    if args.measure:
        for n in args.tokens:
            measure(n, args.chunk, args.reps, args.layers)


if __name__ == "__main__":
    main()
