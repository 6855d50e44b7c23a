"""Shared fixtures. ``ray_session``: ONE local Ray for the whole test session (starting Ray
takes seconds); tests give actors fractional CPUs (0.1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# NOTE: every Ray the tests start (here, in `orch up` subprocesses, in cluster_utils nodes)
# treats 127.0.0.1 as the node address instead of resolving the machine's IP, so test
# servers stay on loopback and a cluster started on 127.0.0.1 is joined on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # NOTE: Ray workers must import this checkout's `orch` and `tests` packages (fake actor
    # classes are pickled by reference), so they get the repository root on PYTHONPATH.
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
