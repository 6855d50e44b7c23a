"""How much of a request's KV transfer is left after its prefill forward ends (``kv_tail_s``,
docs/kv_transfer.md "Layer by layer"): the part that sits between the first and the second
token; the rest crossed the link while prefill computed.

Model: the prompt's prefill (``prefill_s``) produces its KV in ``n`` units, each ready at the
end of its share of the compute (unit ``k`` at ``k * prefill_s / n``), and the link moves them
one after another. Layer by layer a unit is one layer of one chunk (``n = chunks * layers``);
after the forward it is one chunk (``n = chunks``); both of equal bytes, ``transfer_s / n``
each. The link finishes at ``max_k (k p + (n - k + 1) x)`` with ``p = prefill_s / n``,
``x = transfer_s / n``, so the tail after the forward (at ``n p``) is
``max(x, transfer_s - prefill_s + p)``: one unit when the link keeps up, else what it lags
behind plus one unit of compute.

DeepSeek-V4 ships after each chunk's step whatever rows that chunk made final
(docs/kv_transfer.md "DeepSeek-V4: staged per-layer state"), ``kv_transfer.layerwise`` or not:
units of unequal bytes (:func:`v4_chunk_shares`: entries as computed, the final window's rows
only in the last chunks, the open-group state with the last one), run through the same link
(:func:`staged_tail_s`).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.v4.config import V4Config


def kv_tail_s(transfer_s: float, prefill_s: float, chunks: int, layers: int,
              layerwise: bool) -> float:
    """Seconds of KV transfer left when the prefill forward of the last chunk ends.

    Args:
        transfer_s: the whole prompt's KV over the link (``kv_transfer_cost``), seconds.
        prefill_s: the whole prompt's prefill on one DP rank, seconds.
        chunks: prefill chunks of the prompt; layers: model layers.
        layerwise: ``kv_transfer.layerwise`` (units are layers of chunks, else chunks).

    Raises:
        ValueError: ``chunks`` or ``layers`` < 1.
    """
    if chunks < 1 or layers < 1:
        raise ValueError(f"kv_tail_s: chunks ({chunks}) and layers ({layers}) must be >= 1")
    n = chunks * layers if layerwise else chunks
    return max(transfer_s / n, transfer_s - prefill_s + prefill_s / n)


def staged_tail_s(transfer_s: float, prefill_s: float, shares: Sequence[float]) -> float:
    """Seconds of KV transfer left when the prefill forward ends, for ``n = len(shares)``
    units ready at ``k * prefill_s / n`` (``k = 1..n``) carrying ``shares[k - 1]`` of
    ``transfer_s`` each (shares >= 0, summing to 1): the link's run, unit after unit (equal
    shares give :func:`kv_tail_s`).

    Raises:
        ValueError: ``shares`` is empty.
    """
    if not shares:
        raise ValueError("staged_tail_s: no units (a prompt has at least one chunk)")
    free, step = 0.0, prefill_s / len(shares)
    for k, share in enumerate(shares, start=1):
        free = max(free, k * step) + share * transfer_s
    return free - prefill_s


def v4_chunk_shares(config: V4Config, prompt: int, chunk: int) -> list[float]:
    """Per prefill chunk of ``chunk`` tokens of a ``prompt``-token DeepSeek-V4 prompt, the
    share of its shipped bytes sent after that chunk's step: the rows it makes final
    (:func:`engine.v4.row_layout.chunk_rows`, each layer's own rows x its kind's width,
    :func:`engine.v4.staging.kind_widths`), over all of them.

    Raises:
        ValueError: ``prompt`` or ``chunk`` < 1.
    """
    from engine.v4.row_layout import chunk_rows  # noqa: PLC0415 (lazy: torch)
    from engine.v4.staging import kind_widths  # noqa: PLC0415

    if prompt < 1 or chunk < 1:
        raise ValueError(f"v4_chunk_shares: prompt ({prompt}) and chunk ({chunk}) must be >= 1")
    widths = kind_widths(config)
    elements = [sum((r.end - r.start) * sum(widths[config.layer_types[i]] for i in r.layers)
                    for r in chunk_rows(config, prompt, start, min(prompt, start + chunk)))
                for start in range(0, prompt, chunk)]
    return [e / sum(elements) for e in elements]
