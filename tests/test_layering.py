"""The packages keep their layering (DESIGN.md, Layout): no import circles, arrows one way
(orchestrator -> {prefill_worker, decode_worker} -> rank -> kv_transfer -> engine), engine free
of Ray and gRPC, orchestrator/ grouped into sub-packages. The checker (tests/import_graph.py)
is tested on made-up graphs and source trees first, so a pass on the real tree means something.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.import_graph import (PACKAGES, Edge, cycles, edges_of, find_modules, scan,
                                wrong_way)

ROOT = Path(__file__).resolve().parent.parent
MAX_ORCHESTRATOR_MODULES = 12  # files directly in orchestrator/ (sub-packages group the rest)


def _edges(*pairs: tuple[str, str]) -> list[Edge]:
    return [Edge(src, dst, i + 1) for i, (src, dst) in enumerate(pairs)]


def test_checker_reports_a_planted_cycle_and_wrong_way_arrows():
    edges = _edges(("engine.a", "engine.b"), ("engine.b", "engine.c"), ("engine.c", "engine.a"),
                   ("engine.c", "engine.d"),  # d is outside the circle
                   ("kv_transfer.x", "engine.a"),  # downward: fine
                   ("engine.d", "rank.r"),  # upward
                   ("prefill_worker.p", "decode_worker.q"),  # peers
                   ("decode_worker.q", "rank.r"),  # downward: fine
                   ("engine.d", "ray.exceptions"), ("engine.b", "grpc"),
                   ("orchestrator.o", "ray"))  # ray is fine above engine
    modules = {e.source for e in edges} | {"rank.r", "engine.d"}
    assert cycles(edges, modules) == [["engine.a", "engine.b", "engine.c", "engine.a"]]
    arrows = ("arrows: orchestrator -> {prefill_worker, decode_worker} -> rank -> kv_transfer"
              " -> engine")
    assert wrong_way(edges) == [
        f"engine.d:6 imports rank.r (rank is above engine; {arrows})",
        f"prefill_worker.p:7 imports decode_worker.q (peers never import each other; {arrows})",
        "engine.d:9 imports ray.exceptions (engine never imports ray)",
        "engine.b:10 imports grpc (engine never imports grpc)"]


def test_checker_reports_every_circle_as_a_real_path():
    edges = _edges(("rank.a", "rank.b"), ("rank.b", "rank.a"), ("rank.b", "rank.c"),
                   ("rank.c", "rank.d"), ("rank.d", "rank.c"), ("rank.e", "rank.a"))
    found = cycles(edges, ["rank.a", "rank.b", "rank.c", "rank.d", "rank.e"])
    assert found == [["rank.a", "rank.b", "rank.a"], ["rank.c", "rank.d", "rank.c"]]
    graph = {(e.source, e.target) for e in edges}
    for circle in found:
        assert all((a, b) in graph for a, b in zip(circle, circle[1:])), circle
    assert cycles(_edges(("rank.a", "rank.b"), ("rank.b", "rank.c")),
                  ["rank.a", "rank.b", "rank.c"]) == []


def test_scanner_sees_local_type_checking_and_relative_imports(tmp_path):
    pkg = tmp_path / "engine"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("from ..top import thing\n")
    (pkg / "top.py").write_text(textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from rank.messages import Reservation
        import os.path

        def later():
            import ray
            from .sub import leaf
        """))
    modules = find_modules(tmp_path, ["engine"])
    assert sorted(modules) == ["engine", "engine.sub", "engine.sub.leaf", "engine.top"]
    got = {(e.source, e.target, e.line) for e in scan(tmp_path, ["engine"])}
    assert got == {("engine.sub", "engine.sub.leaf", 1), ("engine.sub.leaf", "engine.top", 1),
                   ("engine.top", "typing", 2), ("engine.top", "rank.messages", 4),
                   ("engine.top", "os.path", 5), ("engine.top", "ray", 8),
                   ("engine.top", "engine.sub.leaf", 9)}
    assert cycles(scan(tmp_path, ["engine"]), modules) == [
        ["engine.sub.leaf", "engine.top", "engine.sub.leaf"]]
    problems = wrong_way(scan(tmp_path, ["engine"]))
    assert [p.split(" (")[0] for p in problems] == ["engine.top:4 imports rank.messages",
                                                    "engine.top:8 imports ray"], problems


def test_from_import_of_a_name_points_at_the_module_that_defines_it():
    known = {"kv_transfer", "kv_transfer.plan", "engine.request"}
    edges = edges_of("from kv_transfer import plan, KVPeer\nfrom engine.request import Request\n",
                     "rank.x", False, known)
    assert [(e.target, e.line) for e in edges] == [("kv_transfer.plan", 1), ("kv_transfer", 1),
                                                   ("engine.request", 2)]


def test_no_import_circles():
    modules = find_modules(ROOT)
    found = cycles(scan(ROOT), modules)
    assert found == [], "import circles (untie each, never with a function-local import):\n" \
        + "\n".join(" -> ".join(c) for c in found)


def test_arrows_go_one_way_and_engine_imports_neither_ray_nor_grpc():
    problems = wrong_way(scan(ROOT))
    assert problems == [], "imports against the layering (DESIGN.md, Layout):\n" \
        + "\n".join(problems)


def test_orchestrator_is_grouped_into_sub_packages():
    top = sorted(p.name for p in (ROOT / "orchestrator").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_ORCHESTRATOR_MODULES, (
        f"orchestrator/ holds {len(top)} modules directly ({', '.join(top)}); at most "
        f"{MAX_ORCHESTRATOR_MODULES}: move some into the sub-package of their concern "
        "(router, api, deploy, config, planner, bench)")


def test_every_package_imports_in_a_fresh_interpreter():
    code = f"import {', '.join(PACKAGES)}"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"{code!r} failed:\n{done.stderr}"
