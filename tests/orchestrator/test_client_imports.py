"""The gRPC client imports neither torch nor Ray (DESIGN.md, Layout): a user installs the
client without them. Checked in a fresh interpreter where importing either one fails."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# NOTE: a meta-path finder refuses torch and ray (and their submodules) and records every
# attempt, so an optional `try: import torch` somewhere on the path is caught too.
SCRIPT = textwrap.dedent("""
    import importlib.abc
    import sys

    tried = []

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "ray"):
                tried.append(name)
                raise ImportError(f"{name} is blocked by this test")
            return None

    sys.meta_path.insert(0, Blocker())
    from orchestrator.api.client import AsyncOrchClient, OrchClient, _request

    client = OrchClient("127.0.0.1:1")
    req = _request("hi", None, "r1", max_tokens=3, temperature=0.5, top_p=0.9, seed=7)
    client.close()
    assert (req.text, req.request_id) == ("hi", "r1"), req
    assert (req.sampling.max_tokens, req.sampling.seed) == (3, 7), req
    assert abs(req.sampling.top_p - 0.9) < 1e-6, req
    assert not tried, f"tried to import {tried}"
    print("client ok without torch and ray")
""")


def test_client_imports_and_builds_a_request_without_torch_or_ray():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "client ok without torch and ray" in proc.stdout
