"""The prefix-cache hit rate a plan takes (``--workload hit=P`` or a trace's ``hash_ids``) and
the prompt tokens it leaves to compute and to ship.

- :func:`trace_hit_rate`: the share of a Mooncake trace's prompt blocks a prefix cache finds,
  replaying its requests in order: a request hits the leading run of its ``hash_ids`` already
  seen (equal leading ids = shared prefix, docs/prefix_cache.md), with an unbounded cache
  (the trace's ideal) or one of ``capacity`` blocks evicting the least recently used.
- :func:`cached_tokens`: the tokens of a ``prompt`` a hit rate ``hit`` leaves cached, in whole
  blocks, at most ``(prompt - 1) // block`` of them (the engine computes the last prompt token
  always: its logits give the first token; ``engine/scheduler.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


def cached_tokens(prompt: int, hit: float, block: int) -> int:
    """Prompt tokens served from the prefix cache at hit rate ``hit`` (share of prompt
    tokens), in whole ``block``-token blocks.

    Raises:
        ValueError: ``prompt`` or ``block`` < 1, ``hit`` outside [0, 1].
    """
    if prompt < 1 or block < 1 or not 0.0 <= hit <= 1.0:
        raise ValueError(f"cached_tokens: prompt ({prompt}) and block ({block}) must be >= 1 "
                         f"and hit ({hit}) in [0, 1]")
    return min(int(hit * prompt) // block, (prompt - 1) // block) * block


def trace_hit_rate(requests: Iterable[Sequence[int]], capacity: int | None = None) -> float:
    """Share of the prompt blocks of ``requests`` (each its ``hash_ids``, in arrival order)
    found cached: each request hits the leading run of its ids in the cache, then all its
    ids are in it (most recently used, its head last; beyond ``capacity`` blocks the least
    recently used leave; None: unbounded, the trace's ideal).

    Raises:
        ValueError: no block in ``requests`` (a trace without ``hash_ids``), capacity < 1.
    """
    if capacity is not None and capacity < 1:
        raise ValueError(f"trace_hit_rate: capacity {capacity} blocks must be >= 1")
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for ids in requests:
        run = 0
        while run < len(ids) and ids[run] in cache:
            run += 1
        hits, total = hits + run, total + len(ids)
        # NOTE: the head last, most recent: a tail leaves before its head
        for h in reversed(ids):
            cache[h] = None
            cache.move_to_end(h)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    if total == 0:
        raise ValueError("the trace has no hash_ids (prompt blocks): its hit rate is unknown; "
                         "give --workload ...,hit=P instead")
    return hits / total
