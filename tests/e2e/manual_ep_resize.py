"""MANUAL run (not collected by CI: ~2-5 min on the shared 2-core machine, over the e2e budget):
`orch up configs/ep_1p1d.yaml` (decode dp2 x tp1, expert-parallel), then the decode role
resized live as a whole, 2 -> 4 -> 2, under a steady load of greedy requests:

- each resize brings up a new EP group beside the old one, switches routing, drains the old one
  (router.drain_timeout_s 1 s) and stops it: its processes and placement groups are gone;
- no request fails and every one equals the colocated baseline token for token; long streams
  still on the old group after the drain timeout migrate and complete equal to an undisturbed one;
- prints the times docs/scaling.md reports.

    .venv/bin/python -m pytest -q -s tests/e2e/manual_ep_resize.py
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import REPO, OrchProcess, wait_idle
from tests.e2e.test_rank_death import LONG, Stream, _alive, live_orch_groups, orch_scale

FIRST, SECOND = ["decode-2", "decode-3", "decode-4", "decode-5"], ["decode-6", "decode-7"]


@pytest.fixture(scope="module")
def ep_orch(tmp_path_factory, joined_ray):
    overrides = {**joined_ray, "router.drain_timeout_s": 1.0, "router.request_timeout_s": 300}
    with OrchProcess(REPO / "configs" / "ep_1p1d.yaml", tmp_path_factory.mktemp("ep"),
                     overrides) as orch:
        yield orch


class Load:
    """Two senders of the first prompts, one request after the other, until stopped."""

    def __init__(self, orch: OrchProcess, prompts: list[str]) -> None:
        self.orch, self.prompts, self.stop = orch, prompts, threading.Event()
        self.results: list[tuple[int, list[int], str, object]] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(2)]

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            tokens, responses, err = self.orch.generate(self.prompts[i], max_tokens=MAX_TOKENS)
            decode = responses[-1].stats.decode_instance if responses else ""
            self.results.append((i, tokens, decode, err))

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)


def _resize(orch, ray_session, target: str, olds: list[str], news: list[str]) -> float:
    pids = {name: orch.rank_pids(name) for name in olds}
    done, took = orch_scale(orch, target)
    assert done.returncode == 0, done
    assert f"added {', '.join(news)}; removed {', '.join(olds)}" in done.stdout, done.stdout
    assert sorted(i.name for i in orch.status().instances) == sorted(["prefill-0", *news])
    assert not {f"orch-{n}" for n in olds} & set(live_orch_groups(ray_session).values())
    deadline = time.monotonic() + 30
    while any(_alive(pid) for p in pids.values() for pid in p):
        assert time.monotonic() < deadline, f"the old group's ranks {pids} still run"
        time.sleep(0.2)
    print(f"\n`orch scale {target}` ({', '.join(olds)} -> {', '.join(news)}): {took:.1f} s; "
          f"{done.stdout.strip()}")
    return took


def test_ep_decode_resized_2_4_2_under_load(ep_orch, prompts, colocated_outputs, ray_session):
    orch = ep_orch
    calm = Stream(orch, "a long one", {}, LONG)
    calm.run()
    assert calm.error is None and len(calm.tokens) == LONG
    with Load(orch, prompts) as load:
        while len(load.results) < 2:
            time.sleep(0.1)
        _resize(orch, ray_session, "decode=4", ["decode-0", "decode-1"], FIRST)
        settled = len(load.results)
        while len(load.results) < settled + 2:
            time.sleep(0.1)
        longs = [Stream(orch, "a long one", {}, LONG) for _ in range(4)]
        for stream in longs:
            stream.start()
        while min(len(s.tokens) for s in longs) < 3:
            time.sleep(0.02)
        _resize(orch, ray_session, "decode=2", FIRST, SECOND)
        for stream in longs:
            stream.join(timeout=300)
    assert [e for *_, e in load.results if e is not None] == []
    assert all(tokens == colocated_outputs[i] for i, tokens, _, _ in load.results)
    assert {d for _, _, d, _ in load.results[settled:]} & set(FIRST + SECOND)
    assert [(s.error, s.tokens) for s in longs] == [(None, calm.tokens)] * 4
    log = orch.log.read_text()
    for line in re.findall(r".*(?:EP group \(.*serves|resized \d+ -> \d+ as a whole).*", log):
        print(line.strip())
    print(f"migrations: {orch.metrics().get('orch_migrations_total', 0.0):g}; steady requests: "
          f"{len(load.results)}; a {LONG}-token stream alone {calm.ended - calm.started:.1f} s "
          f"(longest gap {calm.max_gap:.2f} s), the longest of 4 moved by the 4 -> 2 resize "
          f"{max(s.ended - s.started for s in longs):.1f} s (longest gap "
          f"{max(s.max_gap for s in longs):.2f} s)")
    wait_idle(orch)
