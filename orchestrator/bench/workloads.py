"""Workloads: the list of requests a benchmark replays, built from a trace or synthetically.

Each step is a pure function of the config (one seed, one workload): read the trace
(:mod:`.traces`) or make synthetic entries; scale lengths by ``scale_lengths``
(``round(len * f)``, at least 1); cut a request over ``max_input_len`` / ``max_output_len``
(``over_length="cap"``) or drop it (``"skip"``, counted in ``num_skipped`` until
``warmup + num_requests`` are kept); the first ``warmup`` are warm-up (sent one by one, not in
the statistics); arrivals are the trace's rebased to 0, or Poisson / fixed-rate at
``request_rate`` (seeded), times ``time_scale``; prompts are token ids
(:class:`.prompts.TokenPromptFactory`) or ShareGPT text. Every request asks for exactly
``output_len`` tokens, greedy, EOS ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

from orchestrator.bench import traces
from orchestrator.bench.prompts import (TOKEN_HIGH, TOKEN_LOW, TextMeasurer,
                                             TokenPromptFactory)

WorkloadKind = Literal["mooncake", "azure", "sharegpt", "synthetic"]
DEFAULT_TRACES = {
    "mooncake": "mooncake_conversation_trace.jsonl",
    "azure": "azure2023_AzureLLMInferenceTrace_conv.csv",
    "sharegpt": "sharegpt_v3_filtered_1000.json",
}


@dataclass(frozen=True)
class WorkloadConfig:
    """What to replay.

    Attributes:
        kind: "mooncake", "azure", "sharegpt" or "synthetic".
        trace: trace file (None for synthetic).
        num_requests: timed requests; None = every usable entry of the trace.
        warmup: warm-up requests taken before the timed ones.
        seed: seed of prompts and Poisson arrivals.
        time_scale: factor on every arrival time (0.1 replays 10x faster).
        request_rate: requests/s replacing trace times (inf = all at t=0); None keeps the
            trace's times (synthetic and ShareGPT then send everything at t=0).
        arrival: "poisson" (exponential gaps, mean 1/rate) or "fixed" (gaps of 1/rate).
        input_len, output_len: synthetic lengths (tokens); ``output_len`` is also ShareGPT's
            output length.
        scale_lengths: factor on Mooncake/Azure lengths and Mooncake's 512-token prefix
            block (before caps); ShareGPT texts and synthetic lengths are not scaled.
        max_input_len, max_output_len: caps in tokens (None = no cap).
        over_length: "cap" cuts a request to the caps, "skip" drops it.
        tokenizer: tokenizer.json counting ShareGPT prompt tokens (None = DeepSeek-V3's).
        token_range: (low, high): prompt token ids are drawn from [low, high).

    Raises:
        ValueError: on an out-of-range value; the message names the option.
    """

    kind: WorkloadKind = "synthetic"
    trace: Path | None = None
    num_requests: int | None = 100
    warmup: int = 0
    seed: int = 0
    time_scale: float = 1.0
    request_rate: float | None = None
    arrival: Literal["poisson", "fixed"] = "poisson"
    input_len: int = 128
    output_len: int = 128
    scale_lengths: float = 1.0
    max_input_len: int | None = None
    max_output_len: int | None = None
    over_length: Literal["cap", "skip"] = "cap"
    tokenizer: Path | None = None
    token_range: tuple[int, int] = (TOKEN_LOW, TOKEN_HIGH)

    def __post_init__(self) -> None:
        checks = [
            (self.kind in ("mooncake", "azure", "sharegpt", "synthetic"), "--workload"),
            (self.num_requests is None or self.num_requests >= 1, "--num-requests (>= 1)"),
            (self.warmup >= 0, "--warmup (>= 0)"),
            (self.time_scale >= 0 and math.isfinite(self.time_scale), "--time-scale (>= 0)"),
            (self.request_rate is None or self.request_rate > 0, "--request-rate (> 0)"),
            (self.arrival in ("poisson", "fixed"), "--arrival (poisson|fixed)"),
            (self.input_len >= 1 and self.output_len >= 1, "--input-len/--output-len (>= 1)"),
            (0 < self.scale_lengths <= 1e6, "--scale-lengths (> 0)"),
            ((self.max_input_len or 1) >= 1 and (self.max_output_len or 1) >= 1,
             "--max-input-len/--max-output-len (>= 1)"),
            (self.over_length in ("cap", "skip"), "--over-length (cap|skip)"),
            (0 <= self.token_range[0] < self.token_range[1], "--token-range (0 <= LOW < HIGH)"),
            (self.kind == "synthetic" or self.trace is not None, "--trace (a file)"),
            (self.kind != "synthetic" or self.num_requests is not None,
             "--num-requests (synthetic needs a count)"),
        ]
        bad = [name for ok, name in checks if not ok]
        if bad:
            raise ValueError(f"invalid workload option {bad[0]} in {self}")


@dataclass(frozen=True)
class BenchRequest:
    """One request to send.

    Attributes:
        index: position in the workload (warm-up first); the request id is made from it.
        arrival_s: seconds after the timed phase starts when it is due (0 for warm-up).
        input_len: prompt tokens (text prompts: counted with the workload's tokenizer).
        output_len: ``max_tokens`` (EOS ignored).
        prompt_token_ids, prompt_text: int32 array ``[input_len]`` or the text (one is None).
        capped: a cap shortened it. warmup: excluded from the statistics.
    """

    index: int
    arrival_s: float
    input_len: int
    output_len: int
    prompt_token_ids: np.ndarray | None = None
    prompt_text: str | None = None
    capped: bool = False
    warmup: bool = False


@dataclass(frozen=True)
class Workload:
    """Requests to replay plus what the length caps did.

    ``requests``: timed, in the trace's arrival order (``warmup`` sent first, one at a time);
    ``num_capped``: requests a cap shortened; ``num_skipped``: trace entries dropped by
    ``over_length="skip"``; ``description``: one line naming the source.
    """

    warmup: tuple[BenchRequest, ...]
    requests: tuple[BenchRequest, ...]
    num_capped: int
    num_skipped: int
    description: str


def default_trace(kind: str, repo_root: Path) -> Path | None:
    """The public trace file of ``kind`` in the nearest ``shared/data`` folder beside the repo
    or one of its parents (``<repo>/../shared/data`` in a checkout), else None."""
    name = DEFAULT_TRACES.get(kind)
    if name is None:
        return None
    for parent in list(repo_root.resolve().parents)[:3]:
        path = parent / "shared" / "data" / name
        if path.is_file():
            return path
    return None


def _read_entries(cfg: WorkloadConfig, measurer: TextMeasurer | None
                  ) -> list[traces.TraceEntry]:
    if cfg.kind == "synthetic":
        total = (cfg.num_requests or 0) + cfg.warmup
        return [traces.TraceEntry(None, cfg.input_len, cfg.output_len)] * total
    if cfg.kind == "mooncake":
        return traces.read_mooncake(cfg.trace)
    if cfg.kind == "azure":
        return traces.read_azure(cfg.trace)
    entries = traces.read_sharegpt(cfg.trace)
    lengths = measurer.count([e.text for e in entries])
    return [replace(e, input_len=n, output_len=cfg.output_len) for e, n in zip(entries, lengths)]


def _fit(entry: traces.TraceEntry, cfg: WorkloadConfig) -> tuple[int, int, bool] | None:
    """(input_len, output_len, capped) after scaling and caps, or None when skipped."""
    # NOTE: only token-count traces scale; a text prompt is as long as its text.
    scale = cfg.scale_lengths if cfg.kind in ("mooncake", "azure") else 1.0
    n_in = max(1, round(entry.input_len * scale))
    n_out = max(1, round(entry.output_len * scale))
    cap_in = min(n_in, cfg.max_input_len or n_in)
    cap_out = min(n_out, cfg.max_output_len or n_out)
    capped = (cap_in, cap_out) != (n_in, n_out)
    if capped and cfg.over_length == "skip":
        return None
    return cap_in, cap_out, capped


def _arrivals(cfg: WorkloadConfig, kept: list[traces.TraceEntry]) -> np.ndarray:
    """Arrival seconds [len(kept)] of the timed requests, starting at 0."""
    n = len(kept)
    if cfg.request_rate is not None and math.isinf(cfg.request_rate):
        times = np.zeros(n)
    elif cfg.request_rate is not None:
        gaps = (np.random.default_rng([cfg.seed, 2]).exponential(1.0 / cfg.request_rate, n)
                if cfg.arrival == "poisson" else np.full(n, 1.0 / cfg.request_rate))
        times = np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)
    elif n and kept[0].arrival_s is not None:
        times = np.array([e.arrival_s for e in kept]) - kept[0].arrival_s
    else:
        times = np.zeros(n)
    return times * cfg.time_scale


def load_workload(cfg: WorkloadConfig) -> Workload:
    """Build the workload of ``cfg``.

    Raises:
        FileNotFoundError: the trace (or ShareGPT's tokenizer) is missing.
        ValueError: the trace holds fewer usable requests than asked for; the message says
            how many there are.
    """
    measurer = TextMeasurer(cfg.tokenizer) if cfg.kind == "sharegpt" else None
    entries = _read_entries(cfg, measurer)
    want = None if cfg.num_requests is None else cfg.num_requests + cfg.warmup
    kept: list[tuple[traces.TraceEntry, tuple[int, int, bool]]] = []
    skipped = 0
    for entry in entries:
        if want is not None and len(kept) == want:
            break
        fitted = _fit(entry, cfg)
        if fitted is None:
            skipped += 1
        else:
            kept.append((entry, fitted))
    if (want is not None and len(kept) < want) or len(kept) <= cfg.warmup:
        timed = cfg.num_requests if cfg.num_requests is not None else "at least 1"
        raise ValueError(
            f"{cfg.trace} has {len(kept)} usable requests ({skipped} skipped for length) but "
            f"{cfg.warmup} warm-up + {timed} timed were asked for: lower "
            "--num-requests/--warmup, or use --over-length cap / larger caps")
    times = _arrivals(cfg, [e for e, _ in kept[cfg.warmup:]])
    requests = _make_requests(cfg, kept, times, measurer)
    return Workload(warmup=tuple(requests[:cfg.warmup]), requests=tuple(requests[cfg.warmup:]),
                    num_capped=sum(f[2] for _, f in kept), num_skipped=skipped,
                    description=_describe(cfg))


def _make_requests(cfg: WorkloadConfig, kept: list, times: np.ndarray,
                   measurer: TextMeasurer | None) -> list[BenchRequest]:
    block = max(1, round(traces.MOONCAKE_BLOCK_TOKENS * cfg.scale_lengths))
    factory = TokenPromptFactory(cfg.seed, block, *cfg.token_range)
    out: list[BenchRequest] = []
    for i, (entry, (n_in, n_out, capped)) in enumerate(kept):
        warm = i < cfg.warmup
        arrival = 0.0 if warm else float(times[i - cfg.warmup])
        if measurer is not None:
            text = measurer.truncate(entry.text, n_in) if capped else entry.text
            out.append(BenchRequest(i, arrival, n_in, n_out, prompt_text=text,
                                    capped=capped, warmup=warm))
        else:
            ids = factory.prompt(i, n_in, entry.hash_ids)
            out.append(BenchRequest(i, arrival, n_in, n_out, prompt_token_ids=ids,
                                    capped=capped, warmup=warm))
    return out


def _describe(cfg: WorkloadConfig) -> str:
    src = cfg.trace.name if cfg.trace is not None else f"in={cfg.input_len} out={cfg.output_len}"
    rate = "trace times" if cfg.request_rate is None else f"{cfg.arrival} {cfg.request_rate}/s"
    return (f"{cfg.kind} ({src}), arrivals: {rate} x{cfg.time_scale}, "
            f"scale_lengths={cfg.scale_lengths}, caps in={cfg.max_input_len} "
            f"out={cfg.max_output_len} ({cfg.over_length})")
