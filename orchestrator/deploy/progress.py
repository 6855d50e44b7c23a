"""Start-up progress a person can follow: one line per stage and per instance, saying what is
starting, on which node (its IP and the first hex digits of its Ray node id) and how long it
took. Printed to stdout as ``orch up: ...`` lines.
"""

from __future__ import annotations

import time
from typing import Callable

Report = Callable[[str], None]
SHORT_ID = 6  # hex digits of a Ray node id shown beside its IP


def say(line: str) -> None:
    """Print one progress line now (flushed: a log file shows it while start-up runs)."""
    print(f"orch up: {line}", flush=True)


def plural(n: int, word: str, words: str = "") -> str:
    """``plural(1, "rank")`` -> "1 rank", ``plural(2, "rank")`` -> "2 ranks" (``words``: the
    plural when it is not ``word + "s"``)."""
    return f"{n} {word if n == 1 else words or word + 's'}"


class Stopwatch:
    """Seconds since it was made, as text: ``f"ready in {watch}"`` -> "ready in 12.3 s"."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __str__(self) -> str:
        return f"{time.monotonic() - self.start:.1f} s"


def node_ips() -> dict[str, str]:
    """Ray node id (hex) -> that node's IP, for every live node; {} when Ray cannot say."""
    import ray

    try:
        return {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()
                if node.get("Alive")}
    except Exception:  # noqa: BLE001 -- progress text only: fall back to the bare ids
        return {}


def nodes_text(node_ids: list[str], ips: dict[str, str]) -> str:
    """"node 10.0.0.1 (a1b2c3)" for the distinct nodes of ``node_ids`` ("nodes A, B" when
    several)."""
    labels = [f"{ips[n]} ({n[:SHORT_ID]})" if n in ips else n[:SHORT_ID]
              for n in dict.fromkeys(node_ids)]
    return ("node " if len(labels) == 1 else "nodes ") + ", ".join(labels)
