"""DeepSeek-V4 caches in paged storage, per KV group (:mod:`engine.v4.block_table`).

:class:`PagedKV` owns the physical tensors: ``window [L, blocks, block_size, head_dim]`` (one
block id means the same token rows in every layer), per compressed kind ``compressed_kv
[L_kind, blocks, block_size, head_dim]`` and (CSA) ``index_keys [L_kind, blocks, block_size,
index_head_dim]``, a row per entry. A request's :class:`PagedV4Cache` reads and writes its rows
through its :class:`~engine.v4.block_table.RequestBlocks`; the model computes the same as over
a contiguous :class:`~engine.v4.cache.V4Cache` (same interface). The compressors' open-group
state (a fixed size per request, the ``state/<kind>`` group's one block) stays in the request's
objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.block_pool import BlockPool
from engine.kv_groups import KVGroup, kv_groups
from engine.v4.block_table import RequestBlocks
from engine.v4.cache import CompressorState, V4Cache
from engine.v4.config import V4Config
from engine.v4.kv_spec import V4LayerSpec, layer_specs
from engine.v4.state_io import import_request


class PagedKV:
    """Physical storage of every group's rows for ``pools[group].num_blocks`` blocks."""

    def __init__(self, config: V4Config, pools: dict[str, BlockPool], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.config, self.pools, self.specs = config, pools, layer_specs(config)
        self.groups = kv_groups(self.specs)

        def rows(group: str, layers: int, width: int) -> torch.Tensor:
            pool = pools[group]
            return torch.zeros(layers, pool.num_blocks, pool.block_size, width, dtype=dtype,
                               device=device)

        self.window = rows("window", len(self.specs), config.head_dim)
        self.entries: dict[str, torch.Tensor] = {}  # kind -> [L_kind, blocks, bs, D]
        self.index_keys: dict[str, torch.Tensor] = {}
        for g in self.groups:
            if g.name.startswith("entries/"):
                kind = g.name.split("/", 1)[1]
                self.entries[kind] = rows(g.name, len(g.layers), config.head_dim)
                if self.specs[g.layers[0]].index_head_dim:
                    self.index_keys[kind] = rows(g.name, len(g.layers), config.index_head_dim)

    def new_request(self) -> PagedV4Cache:
        """An empty request cache over this storage (blocks taken as it grows)."""
        blocks = RequestBlocks(self.groups, self.pools)
        cache = PagedV4Cache([], blocks=blocks)
        for layer, spec in enumerate(self.specs):
            cache.layers.append(PagedLayerCache(self, cache, layer, spec))
        return cache

    def import_request(self, layers: list[dict[str, torch.Tensor]], num_tokens: int
                       ) -> PagedV4Cache:
        """A request cache after ``num_tokens`` tokens rebuilt from the per-layer tensors
        :func:`engine.v4.state_io.export_request` gives (what a decode instance receives):
        only the blocks those rows need are taken (the window's kept tokens, the entries,
        the state), as :meth:`PagedV4Cache.reserve` would hold them after ``num_tokens``.

        Raises:
            ValueError: a layer's tensors are not exactly its spec's names and shapes.
            NoFreeBlocksError: a group's pool is short (nothing taken).
        """
        shipped = import_request(self.config, layers, num_tokens)
        cache = self.new_request()
        cache.blocks.num_tokens = num_tokens  # NOTE: window blocks from the first kept token
        cache.reserve(num_tokens)
        cache.num_tokens = num_tokens
        for paged, layer in zip(cache.layers, shipped.layers, strict=True):
            rows = layer.window.shape[0]
            paged.storage[paged._window_slots(num_tokens - rows, num_tokens)] = layer.window
            for mine, theirs in ((paged.compressor, layer.compressor),
                                 (paged.indexer, layer.indexer)):
                if mine is None:
                    continue
                mine.append_entries(theirs.entries)
                for name in ("buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate"):
                    setattr(mine, name, getattr(theirs, name))
        return cache


@dataclass
class PagedV4Cache(V4Cache):
    """A request's cache in :class:`PagedKV`; ``free()`` returns its blocks (once)."""

    blocks: RequestBlocks | None = None

    def reserve(self, num_tokens: int) -> None:
        """Take the blocks for tokens up to ``num_tokens``.

        Raises:
            NoFreeBlocksError: a group's pool is short (nothing taken).
        """
        self.blocks.grow(num_tokens)

    def advance(self, num_new: int) -> None:
        """After a step: window blocks no query will read again go back to the pool."""
        self.num_tokens += num_new
        self.blocks.advance(self.num_tokens)

    def free(self) -> None:
        self.blocks.free()


def _slots(block_ids: list[int], first: int, last: int, size: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(physical block, offset) ``[last - first]`` of logical rows ``first .. last - 1``;
    ``block_ids[i]`` holds logical rows ``i * size ...``."""
    rows = torch.arange(first, last)
    return torch.tensor(block_ids, dtype=torch.long)[rows // size], rows % size


class PagedCompressorState(CompressorState):
    """A compressor state whose entries live in ``storage [blocks, bs, d]`` at the request's
    blocks of ``group`` (open-group state in the object)."""

    def __init__(self, storage: torch.Tensor, blocks: RequestBlocks, group: KVGroup) -> None:
        super().__init__(storage.new_zeros(0, storage.shape[-1]))
        self.storage, self.blocks, self.group, self._num = storage, blocks, group, 0

    def _ids(self) -> list[int]:
        return [b for s in self.blocks.sets[self.group.name] for b in s.block_ids]

    @property
    def num_entries(self) -> int:
        return self._num

    @property
    def width(self) -> int:
        return self.storage.shape[-1]

    @property
    def entries(self) -> torch.Tensor:
        return self.read_entries(0, self._num)

    def read_entries(self, first: int, last: int) -> torch.Tensor:
        """Entries ``[first, last)`` (``last <= num_entries``), read from their blocks."""
        block, offset = _slots(self._ids(), first, last, self.storage.shape[1])
        return self.storage[block, offset]

    @entries.setter
    def entries(self, value: torch.Tensor) -> None:
        if value.shape[0]:
            raise ValueError("paged entries are appended with append_entries, not assigned")

    def append_entries(self, new: torch.Tensor) -> torch.Tensor:
        block, offset = _slots(self._ids(), self._num, self._num + new.shape[0],
                               self.storage.shape[1])
        self.storage[block, offset] = new
        self._num += new.shape[0]
        return self.entries


class PagedLayerCache:
    """Layer ``layer`` of a :class:`PagedV4Cache` (the :class:`~engine.v4.cache.LayerCache`
    interface: ``spec``, ``window``, ``extend_window``, ``compressor``, ``indexer``)."""

    def __init__(self, kv: PagedKV, request: PagedV4Cache, layer: int,
                 spec: V4LayerSpec) -> None:
        self.spec, self.request, self.storage = spec, request, kv.window[layer]
        self.compressor = self.indexer = None
        if spec.compress_ratio:
            group = next(g for g in kv.groups if g.name == f"entries/{spec.kind}")
            index = group.layers.index(layer)
            self.compressor = PagedCompressorState(kv.entries[spec.kind][index],
                                                   request.blocks, group)
            if spec.index_head_dim:
                self.indexer = PagedCompressorState(kv.index_keys[spec.kind][index],
                                                    request.blocks, group)

    def _window_slots(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.storage.shape[1]
        ids = dict((index, s.block_ids[0]) for index, s in self.request.blocks.window)
        rows = torch.arange(first, last)
        block = torch.tensor([ids[int(r) // size] for r in rows], dtype=torch.long)
        return block, rows % size

    @property
    def window(self) -> torch.Tensor:
        """``[w, D]``: the last ``sliding_window - 1`` tokens' kv, read from the blocks."""
        n = self.request.num_tokens
        first = max(0, n - (self.spec.sliding_window - 1))
        return self.storage[self._window_slots(first, n)]

    def extend_window(self, kv: torch.Tensor) -> torch.Tensor:
        """Write the step's ``kv [T, D]`` at its tokens' slots; keys ``[w + T, D]``."""
        n = self.request.num_tokens
        keys = torch.cat((self.window, kv))
        self.storage[self._window_slots(n, n + kv.shape[0])] = kv
        return keys
