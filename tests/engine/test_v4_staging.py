"""DeepSeek-V4 staging rows (engine/v4/staging.py): what PD ships. A request's tensors packed
into rows, written at scattered slots and read back are bit-identical; the rows fit the
prompt's slots (``staged_rows(n) <= n``); the tier buffers nest (a layer's buffers are the
layout's first ones) and add up to each kind's width; unpack refuses rows of another shape."""

from __future__ import annotations

import pytest
import torch

from engine.v4.config import V4Config
from engine.v4.kv_spec import layer_specs
from engine.v4.staging import (StagingCache, StagingSpec, kind_widths, pack, staged_rows, tiers,
                               unpack)


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
    rows = staged_rows(config, n)
    slots = torch.randperm(256, generator=torch.Generator().manual_seed(1))[:rows]
    cache.write(slots, pack(config, shipped, n, torch.float32))
    got = unpack(config, cache.read(slots), n)
    for want_layer, got_layer in zip(shipped, got, strict=True):
        assert want_layer.keys() == got_layer.keys()
        for name, t in want_layer.items():
            assert torch.equal(t, got_layer[name]), name
    with pytest.raises(ValueError, match="staged rows"):
        unpack(config, cache.read(slots[:-1] if rows > 1 else slots.repeat(2)), n)
