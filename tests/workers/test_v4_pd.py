"""DeepSeek-V4 through prefill/decode disaggregation, P1 -> D1 in one process (no Ray), driven
as the router drives it (reserve -> prefill -> first token -> admit -> decode): the greedy
tokens equal a colocated V4 runner's (which equal transformers', tests/engine/
test_v4_runner.py) for prompts shorter than the window, longer than it and ending inside a
compression group; every block (scheduler pools, V4 group pools) is free afterwards on both
sides; the state ships chunk by chunk (a long prompt's rows reach decode in several records
before its last chunk, each of a layer's own rows once and none past them: bytes = the sum
over layers of their own rows x width, on both connectors); a layout of other V4 specs, or
of the padded row layout, is refused naming them. Aborts and failed rebuilds:
test_v4_pd_faults.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from decode_worker.role import DecodeRole
from engine.request import RequestSpec
from engine.runner import SeqStep, build_runner
from engine.sampling_params import SamplingParams
from engine.v4.row_layout import ROW_LAYOUT
from engine.v4.staging import kind_widths, layer_rows, staged_rows
from kv_transfer.errors import LayoutMismatchError
from prefill_worker.role import PrefillRole
from rank.messages import Abort, Admit, Prefill, Rejection, Reservation, Reserve
from kv_transfer.config import TransferConfig
from rank.config import InstanceConfig, SchedulerConfig
from rank.kv_setup import staged_layout
from rank.rank import Rank
from tests.workers.test_pd_ranks import run_pd, wait_all_free, wait_events

# NOTE: the tiny V4 model: window 8, ratios 4 (CSA) and 16 (HCA); chunks of 8 split groups
PROMPTS = {"short": 5, "window": 12, "long": 23, "groups": 33}
NEW = 12


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    from orchestrator.cli import main  # noqa: PLC0415

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("v4") / "deepseek_v4"
    assert main(["model", "init-tiny", "--arch", "deepseek_v4", "--seed", "5", str(out)]) == 0
    return out


def start(role_cls, ckpt, role: str, block_size: int = 4, num_kv_blocks: int = 64,
          chunk_size: int = 8, staging_blocks: int = 0, max_model_len: int = 0):
    """An in-process V4 rank of ``role``: chunks of 8, 16 tokens a step, 4 sequences, no
    prefix cache (``max_model_len``: the group pools sized for it, else num_kv_blocks each)."""
    scheduler = SchedulerConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                                chunk_size=chunk_size, max_num_batched_tokens=16, max_num_seqs=4,
                                prefix_cache=False, staging_blocks=staging_blocks,
                                max_model_len=max_model_len)
    transfer = TransferConfig(connect_timeout_s=10, header_timeout_s=10, payload_timeout_s=10,
                              completion_timeout_s=20)
    rank = Rank(InstanceConfig(name=f"{role}-0", role=role, checkpoint_dir=str(ckpt),
                               scheduler=scheduler, transfer=transfer), 0, role_cls)
    rank.start_alone()
    return rank


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 129000, (n,), generator=torch.Generator().manual_seed(seed))
                 .tolist())


def _solo_greedy(ckpt, prompt: tuple[int, ...], new: int) -> list[int]:
    """Greedy tokens of a colocated V4 runner: whole prompt, then ``new - 1`` decode steps."""
    runner = build_runner(ckpt, num_kv_blocks=16, block_size=16)
    table = tuple(range(16))
    out = [int(runner.execute([SeqStep("r", prompt, 0, table)])[0].argmax())]
    for n in range(len(prompt), len(prompt) + new - 1):
        out.append(int(runner.execute([SeqStep("r", (out[-1],), n, table)])[0].argmax()))
    return out


def _v4_free(rank, timeout_s: float = 5.0) -> None:
    """Every V4 group pool of ``rank`` reads free in its status (``kv_groups``: what `orch
    status` and /metrics show), no request cache is left and nothing is committed in its
    admission within ``timeout_s``, with no further request: the rank's idle loop applies
    the releases (the loop may still be finishing a request's last step)."""
    runner, deadline = rank.runner, time.monotonic() + timeout_s
    while True:
        held = {name: total - free for name, free, total in rank.status().kv_groups}
        held.update({f"committed {k}": n for k, n in runner.admission.committed().items()})
        if not any(held.values()) and not runner.caches:
            return
        assert time.monotonic() < deadline, (held, list(runner.caches))
        time.sleep(0.05)


@pytest.fixture(scope="module")
def pd(v4_ckpt):
    prefill = start(PrefillRole, v4_ckpt, "prefill")
    decode = start(DecodeRole, v4_ckpt, "decode", block_size=8)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def test_v4_pd_equals_colocated_and_frees_everything(pd, v4_ckpt):
    prefill, decode = pd
    for seed, (rid, n) in enumerate(PROMPTS.items()):
        prompt = _prompt(n, seed)
        spec = RequestSpec(rid, prompt, SamplingParams(max_tokens=NEW, ignore_eos=True))
        assert run_pd(prefill, decode, spec) == (_solo_greedy(v4_ckpt, prompt, NEW), "length")
    wait_all_free(prefill, decode)
    for rank in (prefill, decode):
        _v4_free(rank)
    runner = prefill.runner
    config = runner.model.config
    widths = kind_widths(config)  # NOTE: benchmarks/v4_kv_bytes.py's row bytes
    per_layer = [runner.kv_spec.bytes_per_token_of([i]) for i in range(config.num_hidden_layers)]
    assert per_layer == [widths[k] * 4 for k in config.layer_types]  # fp32
    assert prefill.status().kv_bytes_sent == sum(_own_bytes(config, n) for n in PROMPTS.values())
    assert all(staged_rows(config, n) <= n for n in range(1, 300))


def _own_bytes(config, n: int) -> int:
    """fp32 bytes a request of ``n`` prompt tokens ships: per layer its own rows x its kind's
    row bytes (no padding rows)."""
    widths = kind_widths(config)
    return sum(r * widths[k] * 4
               for r, k in zip(layer_rows(config, n), config.layer_types, strict=True))


class FreeCounts:
    """Counts each block set's frees on the scheduler pools of ``ranks`` (a second free of a
    set raises in the pool itself; this also sees that every set was freed)."""

    def __init__(self, *ranks) -> None:
        self.pools, self.counts, self.taken = [r.leader.pool for r in ranks], {}, {}
        for pool in self.pools:
            free, allocate = pool.free, pool.allocate

            def counting_free(block_set, free=free, pool=pool):
                key = (id(pool), block_set.set_id)
                self.counts[key] = self.counts.get(key, 0) + 1
                free(block_set)

            def counting_allocate(*args, allocate=allocate, pool=pool, **kwargs):
                block_set = allocate(*args, **kwargs)
                self.taken[(id(pool), block_set.set_id)] = True
                return block_set

            pool.free, pool.allocate = counting_free, counting_allocate

    def undo(self) -> None:
        for pool in self.pools:
            del pool.free, pool.allocate

    def assert_each_once(self) -> None:
        assert self.taken and all(self.counts.get(k) == 1 for k in self.taken), \
            (self.taken, self.counts)


def _hold_before(prefill, rid: str, computed: int):
    """Make the prefill leader's loop wait once ``rid`` has ``computed`` tokens (after that
    step's bookkeeping and sends); returns (held, resume, undo)."""
    held, resume, step = threading.Event(), threading.Event(), prefill.role.step

    def step_then_hold() -> bool:
        busy = step()
        req = prefill.leader.scheduler.find(rid)
        if req is not None and req.num_computed_tokens == computed and not held.is_set():
            held.set()
            resume.wait(30)
        return busy

    prefill.role.step = step_then_hold  # the loop looks up role.step every iteration

    def undo() -> None:
        resume.set()
        prefill.role.step = step

    return held, resume, undo


def _wait(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_v4_state_ships_chunk_by_chunk(pd, v4_ckpt):
    """A 72-token prompt in chunks of 8 (window 8, so its last chunk holds the whole final
    window; a CSA entries row is final every 32 tokens): held before its last chunk, decode
    has already received more than one record and the rows the first eight chunks made
    final (``chunk_rows``), and still waits
    (TRANSFERRING); then the output equals colocated, decode's tracker marked each (layer,
    row) of every layer's own rows exactly once and nothing past them, the bytes sent and
    received equal the sum over layers of their own rows x row bytes (no padding row, no row
    twice), and every scheduler block set on both sides was freed exactly once."""
    from engine.v4.row_layout import chunk_rows  # noqa: PLC0415
    from kv_transfer import KVPoll  # noqa: PLC0415

    prefill, decode = pd
    config, n = prefill.runner.model.config, 72
    spec = RequestSpec("stream", _prompt(n, 11), SamplingParams(max_tokens=NEW, ignore_eos=True))
    per_layer = [w * 4 for w in (kind_widths(config)[k] for k in config.layer_types)]  # fp32
    early = sum(sum(per_layer[i] for i in r.layers) * (r.end - r.start)
                for s in range(0, n - 8, 8) for r in chunk_rows(config, n, s, s + 8))
    total = _own_bytes(config, n)
    assert 0 < early < total < staged_rows(config, n) * sum(per_layer)
    d_conn, p_conn = decode.role.connector, prefill.role.sends.connector
    d_before, p_before = d_conn.stats.snapshot(), p_conn.stats.snapshot()
    counts = FreeCounts(prefill, decode)
    seen = torch.zeros(config.num_hidden_layers, staged_rows(config, n), dtype=torch.int32)
    tracker = d_conn._tracker
    end_write = tracker.end_write

    def counting_end_write(req, chunk, done):  # NOTE: every record written into the slots
        if done and chunk.request_id == spec.request_id:
            seen[list(chunk.layers), chunk.token_start:chunk.token_end] += 1
        end_write(req, chunk, done)

    tracker.end_write = counting_end_write
    held, resume, undo = _hold_before(prefill, spec.request_id, n - 8)
    try:
        res = decode.request(Reserve(spec, 1))
        prefill.request(Prefill(spec, res))
        assert held.wait(30)
        _wait(lambda: d_conn.stats.snapshot()["bytes"] - d_before["bytes"] >= early)
        got = d_conn.stats.snapshot()
        assert got["bytes"] - d_before["bytes"] == early
        assert got["transfers"] - d_before["transfers"] > 1
        assert decode.role.connector.poll(spec.request_id).state is KVPoll.TRANSFERRING
        resume.set()
        (first,) = _first_events(prefill, spec)
        decode.request(Admit(spec.request_id, first.token_ids[0]))
        events = wait_events(decode, spec.request_id, lambda e: e.finish_reason is not None)
    finally:
        undo()
        del tracker.end_write
    want = torch.zeros_like(seen)
    for layer, rows in enumerate(layer_rows(config, n)):
        want[layer, :rows] = 1
    assert torch.equal(seen, want), (seen != want).nonzero()[:5]
    tokens = [*first.token_ids, *(t for e in events for t in e.token_ids)]
    assert tokens == _solo_greedy(v4_ckpt, spec.prompt_token_ids, NEW)
    wait_all_free(prefill, decode)
    counts.undo()
    counts.assert_each_once()
    for rank in (prefill, decode):
        _v4_free(rank)
    assert p_conn.stats.snapshot()["bytes"] - p_before["bytes"] == total
    assert d_conn.stats.snapshot()["bytes"] - d_before["bytes"] == total


def _first_events(prefill, spec):
    return wait_events(prefill, spec.request_id, lambda e: True)


def test_v4_decode_on_planned_pools_holds_max_num_seqs_and_serves(pd, v4_ckpt):
    """A decode whose group pools are sized for 4 requests of 64 tokens (engine/v4/
    pool_plan.py; its 64-block budget would hold 34): four 40 + 20 reservations fit, a fifth
    is refused retryable naming every group (none has room left before the others); with
    them aborted a PD request on these pools equals colocated; every block back."""
    prefill = pd[0]
    small = start(DecodeRole, v4_ckpt, "decode", block_size=8, chunk_size=1, max_model_len=64)
    try:
        pools = small.runner.pools
        assert {n: p.num_blocks for n, p in pools.items()} == {
            "window": 8, "entries/compressed_sparse_attention": 8,
            "state/compressed_sparse_attention": 4, "entries/heavily_compressed_attention": 4,
            "state/heavily_compressed_attention": 4}  # NOTE: 4 x (2, 2, 1, 1, 1)
        specs = [RequestSpec(f"hold{i}", _prompt(40, 30 + i),
                             SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(5)]
        held = [small.request(Reserve(spec, 1)) for spec in specs[:4]]
        assert all(isinstance(r, Reservation) for r in held), held
        full = small.request(Reserve(specs[4], 1))
        assert isinstance(full, Rejection) and full.retryable, full
        assert all(f"{name}: " in full.reason for name in pools), full.reason
        for spec in specs[:4]:
            assert small.request(Abort(spec.request_id))
        wait_all_free(small)
        assert run_pd(prefill, small, specs[4]) == (
            _solo_greedy(v4_ckpt, specs[4].prompt_token_ids, 20), "length")
        wait_all_free(prefill, small)
        for rank in (prefill, small):
            _v4_free(rank)
    finally:
        small.shutdown()


def test_v4_layouts_of_other_specs_are_refused(pd, v4_ckpt, tmp_path):
    """The layout fingerprint carries the V4 specs: another sliding window is refused with
    a message naming layer_specs."""
    import json  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    other = tmp_path / "v4w"
    shutil.copytree(v4_ckpt, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["sliding_window"] = 16
    (other / "config.json").write_text(json.dumps(cfg))
    mine = staged_layout(pd[0].runner.kv_spec, "m", 1)
    theirs = staged_layout(build_runner(other, num_kv_blocks=4, block_size=4).kv_spec, "m", 1)
    assert mine.fingerprint() != theirs.fingerprint()
    with pytest.raises(LayoutMismatchError, match="layer_specs.*different per-layer KV specs"):
        mine.check_compatible(theirs)
    padded = mine.__class__(**{**mine.__dict__, "layer_specs": mine.layer_specs.replace(
        f'"{ROW_LAYOUT}"', '"entries|window+state"')})  # NOTE: the layout that shipped padding
    assert padded.layer_specs != mine.layer_specs
    with pytest.raises(LayoutMismatchError, match="layer_specs.*different per-layer KV specs"):
        mine.check_compatible(padded)
    v3 = mine.__class__(**{**mine.__dict__, "layer_specs": ""})
    with pytest.raises(LayoutMismatchError, match="prefill serves DeepSeek-V4"):
        mine.check_compatible(v3)


def _run_until_decode_ends(prefill, decode, spec, res=None):
    """Reserve (unless ``res`` is given), prefill, admit; the decode side's events of
    ``spec`` until its final one."""
    res = res or decode.request(Reserve(spec, 1))
    prefill.request(Prefill(spec, res))
    (first,) = wait_events(prefill, spec.request_id, lambda e: True)
    decode.request(Admit(spec.request_id, first.token_ids[0]))
    return wait_events(decode, spec.request_id, lambda e: e.finish_reason is not None)


def test_v4_staging_pool_too_small_for_a_prompt_says_raise_v4_staging_blocks(v4_ckpt):
    """A decode whose staging pool (2 blocks of 4 slots) cannot hold a 30-token prompt's 10
    staging rows refuses it for good naming decode.v4_staging_blocks, not a shorter prompt
    (a 40-token one takes fewer rows, but a 31-token one more: config load now refuses such a
    pool, engine.v4.staging.most_staging_blocks); nothing is held after."""
    small = start(DecodeRole, v4_ckpt, "decode", block_size=4, staging_blocks=2)
    try:
        spec = RequestSpec("state-heavy", _prompt(30, 7),
                           SamplingParams(max_tokens=4, ignore_eos=True))
        got = small.request(Reserve(spec, 1))
        assert isinstance(got, Rejection) and not got.retryable, got
        assert got.reason.startswith("request needs 3 KV blocks of 4 tokens; decode-0 has 2 in "
                                     "all: raise decode.v4_staging_blocks"), got.reason
        assert "shorten the prompt or max_tokens" not in got.reason
        wait_all_free(small)
        _v4_free(small)
    finally:
        small.shutdown()


def test_v4_decode_reserves_its_v4_blocks_and_refuses_what_does_not_fit(pd, v4_ckpt):
    """A decode of 4 blocks of 8 per pool (a token a step): a 60 + 10 token request commits
    what it will hold (window 2 blocks, CSA entries 70 // 4 rows = 3 blocks, HCA 1, state 1
    each; its scheduler blocks carry only its 2 blocks of staging rows, in a staging pool of 3
    blocks), where prompt + max_tokens would be 9 blocks, refused outright before. A second
    one while the first runs is refused retryable naming the CSA entries (never a failed
    rebuild), fits once the first ended (one that can never fit is refused for good, naming
    the group); once rebuilt, a request decodes holding one staging
    block; both equal colocated; every block and commitment back."""
    prefill = pd[0]
    small = start(DecodeRole, v4_ckpt, "decode", block_size=8, num_kv_blocks=4, chunk_size=1,
                  staging_blocks=3)
    try:
        assert small.leader.pool.num_blocks == 3  # NOTE: the staging pool (v4_staging_blocks)
        assert small.runner.kv_cache.layer_buffers(0)[0].shape[0] == 3
        specs = [RequestSpec(f"fit{i}", _prompt(60, 20 + i),
                             SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(2)]
        first = small.request(Reserve(specs[0], 1))
        assert isinstance(first, Reservation) and len(first.block_ids) == 2, first
        full = small.request(Reserve(specs[1], 1))
        assert isinstance(full, Rejection) and full.retryable, full
        assert "entries/compressed_sparse_attention: 3 needed, 1 of 4 uncommitted" in \
            full.reason, full.reason
        never = small.request(Reserve(RequestSpec("never", _prompt(60, 22), SamplingParams(
            max_tokens=200, ignore_eos=True)), 1))  # NOTE: 65 CSA entries: 9 blocks of 8
        assert isinstance(never, Rejection) and not never.retryable, never
        assert "entries/compressed_sparse_attention: 9, 4" in never.reason, never.reason
        execute, used = small.runner.execute, []

        def execute_and_count(steps, *args):  # NOTE: scheduler blocks held while decoding
            used.append(small.leader.pool.num_blocks - small.leader.pool.num_free_blocks)
            return execute(steps, *args)

        small.runner.execute = execute_and_count
        try:
            events = _run_until_decode_ends(prefill, small, specs[0], first)
        finally:
            small.runner.execute = execute
        assert events[-1].finish_reason == "length", events[-1]
        assert used and set(used) == {1}  # NOTE: the staging blocks but one back once rebuilt
        wait_all_free(small)
        assert run_pd(prefill, small, specs[1]) == (
            _solo_greedy(v4_ckpt, specs[1].prompt_token_ids, 10), "length")
        wait_all_free(prefill, small)
        for rank in (prefill, small):
            _v4_free(rank)
    finally:
        small.shutdown()
