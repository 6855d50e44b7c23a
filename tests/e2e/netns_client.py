"""A client run inside another network namespace (``ip netns exec NS python -m ...``), where
the test process cannot reach the router. Prints one JSON object on stdout.

``ready ADDRESS TIMEOUT_S``: wait until SERVING; ``{"nodes": {role: [node id, ...]}}``.
``generate ADDRESS MAX_TOKENS`` (prompts as a JSON list on stdin): greedy requests, all at
once; ``{"outputs": [[token id, ...], ...], "kv_bytes_sent": N}`` (N: the prefill side's KV
bytes sent so far, all instances).
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

from orchestrator.api.client import OrchClient


def ready(address: str, timeout_s: float) -> dict:
    with OrchClient(address) as client:
        client.wait_ready(timeout_s)
        instances, _, _ = client.status()
    nodes: dict[str, list[str]] = {}
    for inst in instances:
        ranks = inst.status.ranks if inst.status else ()
        nodes.setdefault(inst.role, []).extend(node for _, node, _, _ in ranks)
    return {"nodes": nodes}


def generate(address: str, max_tokens: int, prompts: list[str]) -> dict:
    with OrchClient(address) as client:
        def one(prompt: str) -> list[int]:
            _, ids, _ = client.generate_text(prompt, max_tokens=max_tokens, temperature=0.0,
                                             timeout_s=120)
            return ids

        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(one, prompts))
        instances, _, _ = client.status()
    sent = sum(inst.status.kv_bytes_sent for inst in instances
               if inst.role == "prefill" and inst.status)
    return {"outputs": outputs, "kv_bytes_sent": sent}


def main(argv: list[str]) -> None:
    command, address, number = argv
    if command == "ready":
        out = ready(address, float(number))
    else:
        out = generate(address, int(number), json.load(sys.stdin))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
