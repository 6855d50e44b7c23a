"""How much of a request's KV transfer is left after its prefill forward ends (``kv_tail_s``,
docs/kv_transfer.md "Layer by layer"): the part that sits between the first and the second
token; the rest crossed the link while prefill computed.

Model: the prompt's prefill (``prefill_s``) produces its KV in ``n`` equal units, each ready
at the end of its share of the compute (unit ``k`` at ``k * prefill_s / n``), and the link
moves them one after another, ``transfer_s / n`` each. Layer by layer a unit is one layer of
one chunk (``n = chunks * layers``); after the forward it is one chunk (``n = chunks``). The
link finishes at ``max_k (k p + (n - k + 1) x)`` with ``p = prefill_s / n``,
``x = transfer_s / n``, so the tail after the forward (at ``n p``) is
``max(x, transfer_s - prefill_s + p)``: one unit when the link keeps up, else what it lags
behind plus one unit of compute.
"""

from __future__ import annotations


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
