"""DeepSeek-V4 staging rows (engine/v4/staging.py, engine/v4/row_layout.py): what PD ships. A
request's tensors packed into rows, written at scattered slots and read back are
bit-identical; the rows fit the prompt's slots (``staged_rows(n) <= n``); each layer ships its
kind's own rows (``layer_rows``, the widest kind's count only on its own layers); the tier
buffers nest (a layer's buffers are the layout's first ones) and add up to each kind's width;
unpack refuses rows of another shape (padded ones too). Chunk by chunk: over a prompt's chunks
each of a layer's own rows is final in exactly one chunk and no row past them in any, rows go
out before the last chunk of a long prompt, and rows staged
from a real runner's cache right after the chunk that made them final equal the rows packed
from its whole state at the end (so no shipped row changes later); a row not final yet is
refused."""

from __future__ import annotations

import pytest
import torch

from engine.block_pool import slot_mapping
from engine.runner import SeqStep, build_runner
from engine.v4.config import V4Config
from engine.v4.kv_spec import layer_specs
from engine.v4.kv_spec import kv_specs
from engine.v4.row_layout import (ROW_LAYOUT, RowRange, chunk_rows, kind_layout, layer_rows,
                                  most_staged_rows)
from engine.v4.staging import (StagingCache, StagingSpec, kind_widths, layout_text,
                               most_staging_blocks, pack, staged_rows, staging_blocks_for,
                               tiers, unpack)
from engine.v4.state_io import export_request


@pytest.fixture(scope="module", params=["tiny", "default"])
def config(request, tiny_v4_ckpt):
    import json  # noqa: PLC0415

    if request.param == "tiny":
        return V4Config.from_dict(json.loads((tiny_v4_ckpt / "config.json").read_text()))
    from transformers import DeepseekV4Config  # noqa: PLC0415 (shapes only)

    return V4Config.from_dict(DeepseekV4Config().to_dict())


def _request(config: V4Config, n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Random tensors of the shapes a request of ``n`` tokens holds (state_io's dicts)."""
    g = torch.Generator().manual_seed(seed)
    return [{t.name: torch.randn(spec.rows(t, n), t.width, generator=g) for t in spec.tensors()}
            for spec in layer_specs(config)]


def test_rows_fit_the_prompt_slots(config):
    for n in [*range(1, 300), 4095, 4096, 4097, 131071]:
        assert 1 <= staged_rows(config, n) <= n


def test_most_staged_rows_is_the_most_over_every_shorter_prompt(config):
    """``most_staged_rows(N)`` (a few hundred evaluations) is the most ``staged_rows(n)`` over
    every ``n <= N`` and names an ``n <= N`` taking it; ``most_staging_blocks`` is its blocks.
    Not ``staged_rows(N)``: the state rows follow ``n % ratio``, so a shorter prompt can take
    more (what config load holds ``v4_staging_blocks`` to)."""
    rows = [staged_rows(config, n) for n in range(1, 701)]
    for top in (1, 2, 7, 8, 30, 127, 128, 129, 255, 256, 257, 383, 500, 700):
        most = max(rows[:top])
        got, n = most_staged_rows(config, top)
        assert got == most and 1 <= n <= top and rows[n - 1] == most, top
        for block in (1, 4, 16):
            assert most_staging_blocks(config, top, block) == (-(-most // block), n)
    assert any(later < earlier for earlier, later in zip(rows, rows[1:]))
    with pytest.raises(ValueError, match="max_tokens"):
        most_staged_rows(config, 0)


def test_staging_blocks_are_not_monotonic_in_the_prompt(tiny_v4_ckpt):
    """The report's case: the tiny model in blocks of 4 slots, a 30-token prompt takes 3
    staging blocks, a 40-token one 2; over prompts up to 256 tokens the most is 4 (255
    tokens), more than the 256-token prompt's 3."""
    import json  # noqa: PLC0415

    tiny = V4Config.from_dict(json.loads((tiny_v4_ckpt / "config.json").read_text()))
    assert staging_blocks_for(tiny, 30, 4) == 3 and staging_blocks_for(tiny, 40, 4) == 2
    assert staging_blocks_for(tiny, 256, 4) == 3
    assert most_staging_blocks(tiny, 256, 4) == (4, 255) == (max(
        staging_blocks_for(tiny, n, 4) for n in range(1, 257)), 255)


@pytest.mark.parametrize("n", [1, 7, 130, 4096, 32768])
def test_each_layer_ships_its_own_kinds_rows(config, n):
    """``layer_rows``: per layer its kind's rows (``kind_layout``), the most of them is
    ``staged_rows``; a kind short of that many rows ships no padding; the layout text names
    the own-rows layout (a peer padding to ``staged_rows`` is refused by the fingerprint)."""
    own = {kind: kind_layout(spec, n).rows for kind, spec in kv_specs(config).items()}
    got = layer_rows(config, n)
    assert got == tuple(own[kind] for kind in config.layer_types)
    assert max(got) == staged_rows(config, n) and min(got) >= 1
    widths = kind_widths(config)
    shipped = sum(r * widths[k] for r, k in zip(got, config.layer_types, strict=True))
    padded = staged_rows(config, n) * sum(widths[k] for k in config.layer_types)
    assert (shipped < padded) == (len(set(got)) > 1)
    assert f'"rows":"{ROW_LAYOUT}"' in layout_text(config) and "own-rows" in ROW_LAYOUT


def test_tiers_nest_and_add_up_to_each_kind(config):
    spec = StagingSpec(config.num_hidden_layers, 1, 1, tiers(config), torch.float32)
    widths = kind_widths(config)
    names = spec.buffer_names
    for layer, kind in enumerate(config.layer_types):
        have = [name for name, (_, layers) in zip(names, spec.tiers) if layer in layers]
        assert have == list(names[:len(have)])  # a prefix of the layout's buffers
        assert sum(spec.layer_widths(layer)) == widths[kind]


@pytest.mark.parametrize("n", [1, 5, 8, 23, 33, 130])
def test_pack_write_read_unpack_is_exact(tiny_v4_ckpt, n):
    import json  # noqa: PLC0415

    config = V4Config.from_dict(json.loads((tiny_v4_ckpt / "config.json").read_text()))
    shipped = _request(config, n, seed=n)
    cache = StagingCache(StagingSpec(config.num_hidden_layers, 64, 4, tiers(config),
                                     torch.float32))
    rows, own = staged_rows(config, n), layer_rows(config, n)
    slots = torch.randperm(256, generator=torch.Generator().manual_seed(1))[:rows]
    packed = pack(config, shipped, n, torch.float32)
    assert [tuple(r.shape) for r in packed] == [
        (r, kind_widths(config)[k]) for r, k in zip(own, config.layer_types, strict=True)]
    cache.write(slots, packed)
    got = unpack(config, cache.read(slots, own), n)
    for want_layer, got_layer in zip(shipped, got, strict=True):
        assert want_layer.keys() == got_layer.keys()
        for name, t in want_layer.items():
            assert torch.equal(t, got_layer[name]), name
    with pytest.raises(ValueError, match="staged rows"):  # NOTE: one row too many per layer
        unpack(config, [torch.cat([r, r[:1]]) for r in cache.read(slots, own)], n)
    if len(set(own)) > 1:  # NOTE: every layer padded to staged_rows: not the specs' rows
        with pytest.raises(ValueError, match="staged rows"):
            unpack(config, cache.read(slots), n)


@pytest.mark.parametrize("n,chunk", [(1, 1), (5, 2), (33, 8), (130, 7), (130, 130),
                                     (1000, 64), (4097, 512)])
def test_chunks_make_every_row_final_exactly_once(config, n, chunk):
    """Consecutive chunks of a prompt: each of a layer's own rows (``layer_rows``) is in
    exactly one chunk's ranges and no row of ``[layers, staged_rows(n)]`` past them in any; a
    prompt of more than one chunk past the window ships rows before its last chunk (compressed
    entries, then window rows), and its last chunk ships fewer rows than all of them (the
    state and the rows still open)."""
    seen = torch.zeros(config.num_hidden_layers, staged_rows(config, n), dtype=torch.int32)
    early = 0
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        for rows in chunk_rows(config, n, start, end):
            assert list(rows.layers) == sorted(set(rows.layers)) and rows.start < rows.end
            seen[list(rows.layers), rows.start:rows.end] += 1
            if end < n:
                early += len(rows.layers) * (rows.end - rows.start)
    want = torch.zeros_like(seen)
    for layer, rows in enumerate(layer_rows(config, n)):
        want[layer, :rows] = 1
    assert torch.equal(seen, want), (seen != want).nonzero()[:5]
    if n > 2 * chunk and n - chunk > config.sliding_window:
        assert 0 < early < int(want.sum())
    with pytest.raises(ValueError, match="chunk"):
        chunk_rows(config, n, 0, n + 1)


@pytest.mark.parametrize("n,chunk", [(5, 2), (12, 8), (23, 8), (33, 8), (40, 3), (47, 16)])
def test_rows_staged_chunk_by_chunk_equal_the_final_state(tiny_v4_ckpt, n, chunk):
    """A real (tiny) runner prefills ``n`` tokens in chunks; after each chunk the rows it made
    final are staged from the live cache (``V4Runner.stage_rows``). At the end they are
    bit-identical to the rows packed from the whole exported state, and unpack to it."""
    torch.manual_seed(0)
    runner = build_runner(tiny_v4_ckpt, num_kv_blocks=64, block_size=4)
    config, table = runner.model.config, tuple(range(16))
    prompt = tuple(torch.randint(0, 1000, (n,)).tolist())
    total = staged_rows(config, n)
    last_csa = kind_layout(layer_specs(config)[3], n).rows - 1  # NOTE: holds CSA state
    slots = torch.randperm(64 * 4, generator=torch.Generator().manual_seed(n))[:total]
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        runner.execute([SeqStep("r", prompt[start:end], start, table)])
        if end < n:  # NOTE: the open-group state is not final before the prompt's end
            with pytest.raises(ValueError, match="final only after"):
                runner.stage_rows("r", n, RowRange(last_csa, last_csa + 1, (3,)), slots[:1])
        for rows in runner.chunk_rows(n, start, end):
            runner.stage_rows("r", n, rows, slots[rows.start:rows.end])
    want = pack(config, export_request(runner.caches["r"]), n, runner.dtype)
    got = runner.kv_cache.read(slots, runner.layer_rows(n))
    for layer, (w, g) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(w, g), layer
    for w, g in zip(export_request(runner.caches["r"]), unpack(config, got, n), strict=True):
        assert all(torch.equal(w[name], g[name]) for name in w)


def test_a_row_not_computed_yet_is_refused(tiny_v4_ckpt):
    """Staging a chunk's rows before the chunk ran: the reader names what is missing."""
    runner = build_runner(tiny_v4_ckpt, num_kv_blocks=64, block_size=4)
    runner.execute([SeqStep("r", tuple(range(8)), 0, tuple(range(16)))])
    (entries, *_rest) = runner.chunk_rows(40, 8, 40)  # NOTE: CSA entries 2 on, not computed
    with pytest.raises(ValueError, match="computed after 8 tokens"):
        runner.stage_rows("r", 40, entries,
                          slot_mapping(tuple(range(16)), entries.start, entries.end, 4))
