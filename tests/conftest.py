"""Shared fixtures. ``ray_session``: ONE local Ray for the whole test session (starting Ray
takes seconds); tests give actors fractional CPUs (0.1). ``shared_data``: the public data files
beside the repository (``../shared/data``), a clear failure when one is missing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent

# NOTE: every Ray the tests start (here, in `orch up` subprocesses, in cluster_utils nodes)
# treats 127.0.0.1 as the node address instead of resolving the machine's IP, so test
# servers stay on loopback and a cluster started on 127.0.0.1 is joined on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def shared_data() -> Callable[[str], Path]:
    """``shared_data(NAME)``: the path of ``NAME`` in the nearest ``shared/data`` folder beside
    the repository or above it (``<repo>/../shared/data`` in a checkout; the same search as the
    bench CLI's default trace, ``orchestrator.bench.workloads.default_trace``).

    Fails the calling test (never skips: CI always has the data) with the file's name and
    every place it was looked for.
    """
    def path_of(name: str) -> Path:
        places = [parent / "shared" / "data" / name for parent in list(ROOT.parents)[:3]]
        for path in places:
            if path.is_file():
                return path
        pytest.fail(f"public data file {name} is missing: expected at ../shared/data/{name} "
                    f"beside the repository (looked at {', '.join(map(str, places))}); every "
                    "checkout and CI has ../shared/data, see ../shared/data/README.md",
                    pytrace=False)

    return path_of


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # NOTE: Ray workers must import this checkout's `orch` and `tests` packages (fake actor
    # classes are pickled by reference), so they get the repository root on PYTHONPATH.
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # NOTE: address="local": always a new cluster, never one already running on this machine
    # (a `ray start` there, RAY_ADDRESS) that a bare ray.init() would join.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
