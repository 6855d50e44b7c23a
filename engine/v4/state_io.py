"""A request's V4 cache as named tensors, one dict per layer, checked against the layer kind's
:class:`~engine.v4.kv_spec.V4LayerSpec`: what a prefill instance ships to a decode instance
(the window, the compressed entries, the indexer keys and the compressors' open-group state),
not the whole prompt's KV.

NOTE: names are :class:`~engine.v4.kv_spec.CachedTensor` names; a tensor with zero rows (no
open group, no entry yet) is shipped empty, so the receiver never guesses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.v4.cache import CompressorState, LayerCache, V4Cache
from engine.v4.config import V4Config
from engine.v4.kv_spec import V4LayerSpec, layer_specs


def export_request(cache: V4Cache) -> list[dict[str, torch.Tensor]]:
    """Layer i's tensors ``{name: [rows, width]}`` (rows as ``spec.rows(t, num_tokens)``)."""
    out = []
    for layer in cache.layers:
        tensors = {"window_kv": layer.window}
        for state, entries in ((layer.compressor, "compressed_kv"),
                               (layer.indexer, "index_keys")):
            if state is not None:
                tensors[entries] = state.entries
        tensors.update(_open_groups(layer))
        _check(layer.spec, tensors, cache.num_tokens)
        out.append(tensors)
    return out


def _open_groups(layer: LayerCache) -> dict[str, torch.Tensor]:
    """The layer's ``request`` tensors (compressor / indexer open-group state), by name; the
    empty ones ``[0, width]``."""
    tensors = {}
    for prefix, state in (("compressor", layer.compressor), ("indexer", layer.indexer)):
        if state is None:
            continue
        width, none = state.width, state.read_entries(0, 0)  # NOTE: [0, width]: dtype, device
        coff = 2 if layer.spec.overlap else 1
        for part in ("kv", "gate"):
            buffer = getattr(state, f"buffer_{part}")
            tensors[f"{prefix}_buffer_{part}"] = (
                buffer if buffer is not None else none.new_zeros(0, coff * width))
            if layer.spec.overlap:
                overlap = getattr(state, f"overlap_{part}")
                tensors[f"{prefix}_overlap_{part}"] = (
                    overlap if overlap is not None else none)
    return tensors


def cache_reader(cache: V4Cache, layer: int, num_prompt_tokens: int
                 ) -> Callable[[str, int, int], torch.Tensor]:
    """Prefill: ``read(name, first, last)`` -> rows ``[first, last)`` of layer ``layer``'s
    tensor ``name`` as a request of ``num_prompt_tokens`` tokens holds it at the end of its
    prompt (:mod:`engine.v4.row_layout`'s reader), from ``cache`` part way through it:
    ``window_kv`` row ``i`` is token ``num_prompt_tokens - min(num_prompt_tokens, W - 1) +
    i``; entries by index; the open-group state only once the whole prompt is in ``cache``.

    Raises:
        ValueError: the rows asked for are not final yet (a token or entry not computed, the
            state before the prompt's end), or the window no longer holds the token.
    """
    lay, n = cache.layers[layer], num_prompt_tokens
    states = {"compressed_kv": lay.compressor, "index_keys": lay.indexer}

    def read(name: str, first: int, last: int) -> torch.Tensor:
        e = cache.num_tokens
        if name == "window_kv":
            window = lay.window  # NOTE: tokens [e - len(window), e)
            lo = n - min(n, lay.spec.sliding_window - 1) + first - (e - window.shape[0])
            if lo < 0 or lo + last - first > window.shape[0]:
                raise ValueError(f"layer {layer}: window rows [{first}, {last}) of a {n}-token "
                                 f"prompt are not in the window after {e} tokens")
            return window[lo:lo + last - first]
        if name in states:
            state = states[name]
            if last > state.num_entries:
                raise ValueError(f"layer {layer}: {name} [{first}, {last}) asked for, "
                                 f"{state.num_entries} computed after {e} tokens")
            return state.read_entries(first, last)
        if e != n:
            raise ValueError(f"layer {layer}: {name} (open-group state) is final only after "
                             f"the prompt's {n} tokens; {e} computed")
        return _open_groups(lay)[name][first:last]

    return read


def import_request(config: V4Config, layers: list[dict[str, torch.Tensor]],
                   num_tokens: int) -> V4Cache:
    """The :class:`V4Cache` of :func:`export_request`'s output after ``num_tokens`` tokens.

    Raises:
        ValueError: a layer's tensors are not exactly its spec's names and shapes.
    """
    specs = layer_specs(config)
    if len(layers) != len(specs):
        raise ValueError(f"{len(layers)} layers shipped; the model has {len(specs)}")
    caches = []
    for spec, tensors in zip(specs, layers, strict=True):
        _check(spec, tensors, num_tokens)
        caches.append(LayerCache(spec, tensors["window_kv"],
                                 _state(tensors, "compressor", "compressed_kv"),
                                 _state(tensors, "indexer", "index_keys")))
    return V4Cache(caches, num_tokens)


def _state(tensors: dict[str, torch.Tensor], prefix: str, entries: str
           ) -> CompressorState | None:
    if entries not in tensors:
        return None

    def opt(name: str) -> torch.Tensor | None:
        t = tensors.get(f"{prefix}_{name}")
        return t if t is not None and t.shape[0] else None

    return CompressorState(tensors[entries], opt("buffer_kv"), opt("buffer_gate"),
                           opt("overlap_kv"), opt("overlap_gate"))


def _check(spec: V4LayerSpec, tensors: dict[str, torch.Tensor], num_tokens: int) -> None:
    """Raise ValueError unless ``tensors`` has exactly the spec's names and shapes."""
    want = {t.name: (spec.rows(t, num_tokens), t.width) for t in spec.tensors()}
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != want:
        raise ValueError(f"{spec.kind} layer after {num_tokens} tokens holds {want}; got {got}")
