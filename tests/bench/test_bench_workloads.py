"""Workload loaders against the real public traces in ../shared/data."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from orchestrator.bench import traces
from orchestrator.bench.prompts import TOKEN_HIGH, TOKEN_LOW, TextMeasurer
from orchestrator.bench.workloads import (DEFAULT_TRACES, WorkloadConfig, default_trace,
                                          load_workload)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def trace_file(shared_data):
    """``trace_file(KIND)``: the public trace file of ``KIND`` (fails when it is missing)."""
    return lambda kind: shared_data(DEFAULT_TRACES[kind])


def test_default_traces_are_the_shared_files(shared_data):
    for kind, name in DEFAULT_TRACES.items():
        assert default_trace(kind, ROOT) == shared_data(name), kind
    assert default_trace("synthetic", ROOT) is None


def _mooncake_raw(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_mooncake_trace_matches_file(trace_file):
    path = trace_file("mooncake")
    raw = _mooncake_raw(path)
    entries = traces.read_mooncake(path)
    assert len(raw) == 12031 and len(entries) == 12031
    arrivals = np.array([e.arrival_s for e in entries])
    assert np.all(np.diff(arrivals) >= 0) and arrivals[0] == 0.0
    t0 = raw[0]["timestamp"]
    assert arrivals[-1] == pytest.approx((raw[-1]["timestamp"] - t0) / 1000)
    assert [e.input_len for e in entries] == [x["input_length"] for x in raw]
    assert [e.output_len for e in entries] == [x["output_length"] for x in raw]
    assert [list(e.hash_ids) for e in entries] == [x["hash_ids"] for x in raw]
    # NOTE: full-length prompts of the whole trace are ~600 MB; build the first 300 only.
    n = 300
    wl = load_workload(WorkloadConfig(kind="mooncake", trace=path, num_requests=n))
    assert (wl.num_capped, wl.num_skipped, wl.warmup) == (0, 0, ())
    assert [r.input_len for r in wl.requests] == [x["input_length"] for x in raw[:n]]
    assert [r.output_len for r in wl.requests] == [x["output_length"] for x in raw[:n]]
    assert [r.arrival_s for r in wl.requests] == pytest.approx(list(arrivals[:n]))
    assert all(len(r.prompt_token_ids) == r.input_len for r in wl.requests)


def test_mooncake_synthetic_trace_count(shared_data):
    path = shared_data("mooncake_synthetic_trace.jsonl")
    assert len(traces.read_mooncake(path)) == 3993


@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_mooncake_shared_hash_ids_share_prompt_prefix(scale, trace_file):
    path = trace_file("mooncake")
    raw = _mooncake_raw(path)[:40]
    wl = load_workload(WorkloadConfig(kind="mooncake", trace=path, num_requests=40,
                                      scale_lengths=scale))
    block = max(1, round(512 * scale))
    pairs = 0
    for i in range(40):
        for j in range(i + 1, 40):
            hi, hj = raw[i]["hash_ids"], raw[j]["hash_ids"]
            k = next((n for n, (a, b) in enumerate(zip(hi, hj)) if a != b), min(len(hi), len(hj)))
            if k == 0:
                continue
            pi, pj = wl.requests[i].prompt_token_ids, wl.requests[j].prompt_token_ids
            shared = min(k * block, len(pi), len(pj))
            assert np.array_equal(pi[:shared], pj[:shared])
            pairs += 1
            end = min((k + 1) * block, len(pi), len(pj))
            if k < min(len(hi), len(hj)) and end > k * block:
                # the first differing block differs (random ids: equal with prob ~1e-5)
                assert not np.array_equal(pi[k * block:end], pj[k * block:end])
    assert pairs > 100  # the first requests all start with hash id 0
    r0 = wl.requests[0]
    assert r0.input_len == max(1, round(raw[0]["input_length"] * scale))


def test_mooncake_caps_and_skips_counted(trace_file):
    path = trace_file("mooncake")
    raw = _mooncake_raw(path)
    cap_in, cap_out, n = 4096, 256, 200
    over = [x["input_length"] > cap_in or x["output_length"] > cap_out for x in raw]
    capped = load_workload(WorkloadConfig(kind="mooncake", trace=path, num_requests=n,
                                          max_input_len=cap_in, max_output_len=cap_out))
    assert capped.num_capped == sum(over[:n]) > 0 and capped.num_skipped == 0
    for r, x in zip(capped.requests, raw):
        assert r.input_len == min(x["input_length"], cap_in)
        assert r.output_len == min(x["output_length"], cap_out)
        assert r.capped == (x["input_length"] > cap_in or x["output_length"] > cap_out)
    skipped = load_workload(WorkloadConfig(kind="mooncake", trace=path, num_requests=n,
                                           max_input_len=cap_in, max_output_len=cap_out,
                                           over_length="skip"))
    fits = [i for i, o in enumerate(over) if not o][:n]
    assert skipped.num_capped == 0 and len(skipped.requests) == n
    assert skipped.num_skipped == sum(over[:fits[-1] + 1])
    assert [r.input_len for r in skipped.requests] == [raw[i]["input_length"] for i in fits]
    assert skipped.requests[0].arrival_s == 0.0
    t_first = raw[fits[0]]["timestamp"]
    assert skipped.requests[-1].arrival_s == pytest.approx(
        (raw[fits[-1]]["timestamp"] - t_first) / 1000)


def test_azure_timestamps_and_lengths(trace_file):
    path = trace_file("azure")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    n = 2000
    wl = load_workload(WorkloadConfig(kind="azure", trace=path, num_requests=n, warmup=1))
    assert len(rows) == 19366 and len(wl.requests) == n and len(wl.warmup) == 1
    assert traces.parse_azure_timestamp("2023-11-16 18:15:50.9951690") - \
        traces.parse_azure_timestamp("2023-11-16 18:15:46.6805900") == pytest.approx(4.314579)
    assert traces.parse_azure_timestamp("1970-01-01 00:00:01.5") == 1.5
    entries = traces.read_azure(path)
    assert len(entries) == 19366
    assert [e.input_len for e in entries] == [int(x["ContextTokens"]) for x in rows]
    assert [e.output_len for e in entries] == [int(x["GeneratedTokens"]) for x in rows]
    assert entries[0].arrival_s == 0.0 and entries[1].arrival_s == pytest.approx(4.314579)
    assert 3400 < entries[-1].arrival_s < 3600  # ~58 min
    arrivals = np.array([r.arrival_s for r in wl.requests])
    assert np.all(np.diff(arrivals) >= 0) and arrivals[0] == 0.0
    assert np.all(np.diff([e.arrival_s for e in entries]) >= 0)
    assert arrivals[-1] == pytest.approx(entries[n].arrival_s - entries[1].arrival_s)
    assert [r.input_len for r in wl.requests] == [e.input_len for e in entries[1:n + 1]]
    assert [r.output_len for r in wl.requests] == [e.output_len for e in entries[1:n + 1]]


def test_scale_lengths_and_time_scale(trace_file):
    path = trace_file("azure")
    rows = traces.read_azure(path)[:30]
    wl = load_workload(WorkloadConfig(kind="azure", trace=path, num_requests=30,
                                      scale_lengths=0.1, time_scale=0.5))
    for r, e in zip(wl.requests, rows):
        assert r.input_len == max(1, round(e.input_len * 0.1))
        assert r.output_len == max(1, round(e.output_len * 0.1))
        assert r.arrival_s == pytest.approx(e.arrival_s * 0.5)
    assert wl.num_capped == 0


def test_sharegpt_first_human_turn_and_caps(trace_file):
    path = trace_file("sharegpt")
    data = json.loads(path.read_text())
    wl = load_workload(WorkloadConfig(kind="sharegpt", trace=path, num_requests=20,
                                      output_len=33, max_input_len=64))
    firsts = [next(t["value"] for t in c["conversations"] if t["from"] == "human")
              for c in data][:20]
    measurer = TextMeasurer()
    lengths = measurer.count(firsts)
    assert wl.num_capped == sum(n > 64 for n in lengths) > 0
    for r, text, n in zip(wl.requests, firsts, lengths):
        assert r.output_len == 33 and r.prompt_token_ids is None
        assert r.input_len == min(n, 64)
        if n <= 64:
            assert r.prompt_text == text
        else:
            assert r.capped and text.startswith(r.prompt_text[:20])
            assert measurer.count([r.prompt_text])[0] <= 66  # re-tokenizing may merge/split


def test_synthetic_poisson_fixed_and_determinism():
    cfg = WorkloadConfig(kind="synthetic", num_requests=2000, input_len=8, output_len=4,
                         request_rate=20.0, seed=7)
    a, b = load_workload(cfg), load_workload(cfg)
    times = np.array([r.arrival_s for r in a.requests])
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    assert np.mean(np.diff(times)) == pytest.approx(1 / 20, rel=0.1)
    assert np.array_equal(times, [r.arrival_s for r in b.requests])
    assert all(np.array_equal(x.prompt_token_ids, y.prompt_token_ids)
               for x, y in zip(a.requests[:10], b.requests[:10]))
    other = load_workload(WorkloadConfig(kind="synthetic", num_requests=3, input_len=8, seed=8))
    assert not np.array_equal(other.requests[0].prompt_token_ids, a.requests[0].prompt_token_ids)
    ids = np.concatenate([r.prompt_token_ids for r in a.requests])
    assert ids.min() >= TOKEN_LOW and ids.max() < TOKEN_HIGH
    narrow = load_workload(WorkloadConfig(kind="synthetic", num_requests=2, input_len=500,
                                          token_range=(5, 9)))
    ids = narrow.requests[0].prompt_token_ids
    assert ids.min() >= 5 and ids.max() < 9 and len(set(ids.tolist())) == 4
    fixed = load_workload(WorkloadConfig(kind="synthetic", num_requests=4, request_rate=4.0,
                                         arrival="fixed", time_scale=2.0))
    assert [r.arrival_s for r in fixed.requests] == pytest.approx([0, 0.5, 1.0, 1.5])


def test_bad_options_say_what_to_do(trace_file):
    with pytest.raises(ValueError, match="--num-requests"):
        load_workload(WorkloadConfig(kind="mooncake", trace=trace_file("mooncake"),
                                     num_requests=20000))
    with pytest.raises(ValueError, match="--over-length"):
        WorkloadConfig(over_length="drop")
    with pytest.raises(FileNotFoundError, match="--trace"):
        load_workload(WorkloadConfig(kind="azure", trace=Path("/nonexistent.csv")))


def test_an_empty_trace_says_it_has_no_requests(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="has 0 usable requests .* at least 1 timed"):
        load_workload(WorkloadConfig(kind="mooncake", trace=empty, num_requests=None))
