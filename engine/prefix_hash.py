"""Chained hashes of full KV blocks: the prefix cache's keys (vLLM's automatic prefix caching).

Block ``i`` of a sequence (tokens ``[i * block_size, (i + 1) * block_size)``) is named by
``h_i = H(h_{i-1}, tokens of block i)`` with ``h_{-1} = salt``: equal hashes mean an equal
whole prefix, so one lookup per block finds the longest cached prefix. The salt folds in what
changes the KV of the same tokens (checkpoint, dtype, weight storage): two instances agree on
a hash only when their KV for it would be identical. Deterministic across processes (BLAKE2b,
not Python's ``hash``), so the router computes the same keys the instances report.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_MASK = (1 << 63) - 1


def cache_salt(*parts: str) -> int:
    """The root of every chain for KV made under ``parts`` (e.g. checkpoint, dtype): a
    63-bit int."""
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def block_hashes(token_ids: Sequence[int], block_size: int, salt: int = 0,
                 parents: Sequence[int] = ()) -> list[int]:
    """Hashes of every full block of ``token_ids``.

    Args:
        token_ids: the sequence from position 0.
        block_size: tokens per block.
        salt: the chain's root (:func:`cache_salt`).
        parents: hashes already known for the first ``len(parents)`` blocks; only the
            blocks after them are hashed (incremental use as a sequence grows).

    Returns:
        ``len(token_ids) // block_size`` 63-bit ints, ``parents`` first.
    """
    out = list(parents)
    prev = out[-1] if out else salt
    for i in range(len(out), len(token_ids) // block_size):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        h = hashlib.blake2b(prev.to_bytes(8, "little") + block, digest_size=8)
        prev = int.from_bytes(h.digest(), "little") & _MASK
        out.append(prev)
    return out


def reusable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Most leading blocks of a ``num_prompt_tokens``-token prompt a prefix-cache hit may
    cover: ``(prompt - 1) // block_size``, so the last prompt token is always computed (its
    logits give the first output token). The scheduler admits by it and the router's KV index
    counts by it, so the router's view of a hit is the engine's."""
    return max(num_prompt_tokens - 1, 0) // block_size
