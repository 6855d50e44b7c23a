"""A real colocated rank (TP=1, no Ray) answers its leader calls over the call socket as over a
direct (Ray-path) call: the same tokens, the same answers, the same error text; its shutdown
closes the call server and leaves no thread of it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import torch

from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from orchestrator.router.leader import LeaderClient, LeaderError
from orchestrator.tiny_model import write_tiny_checkpoint
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Abort, Generate, Reserve
from rank.rank import Rank
from tests.orchestrator.fakes import Remote
from tests.orchestrator.test_leader_calls import RayHandle
from tests.workers.test_colocated_rank import collect


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


def _spec(rid: str) -> RequestSpec:
    return RequestSpec(rid, (11, 12, 13, 14, 15), SamplingParams(max_tokens=6, ignore_eos=True))


async def _outcomes(client: LeaderClient, rid: str) -> list:
    out = []
    for request in (Generate(_spec(rid)), Abort("nobody"), Reserve(_spec(rid + "-r"))):
        try:
            out.append(("answer", await client.call(request)))
        except LeaderError as exc:
            out.append(("error", str(exc)))
    return out


def test_calls_over_the_socket_equal_the_ray_path_and_close_with_the_rank(ckpt):
    scheduler = SchedulerConfig(block_size=4, num_kv_blocks=32, chunk_size=8,
                                max_num_batched_tokens=12, max_num_seqs=3)
    rank = Rank(InstanceConfig(name="colocated-9", role="colocated", checkpoint_dir=str(ckpt),
                               scheduler=scheduler), 0, ColocatedRole)
    rank.start_alone()
    try:
        async def go():
            ray = LeaderClient("colocated-9", "colocated", RayHandle(rank), 30.0)
            sock = LeaderClient("colocated-9", "colocated", RayHandle(rank), 30.0,
                                calls="socket")
            try:
                return await _outcomes(ray, "via-ray"), await _outcomes(sock, "via-socket")
            finally:
                await sock.close()
        over_ray, over_socket = asyncio.run(asyncio.wait_for(go(), 60))
        assert over_socket == over_ray
        assert over_socket[1] == ("answer", False)
        assert over_socket[2][1].startswith("colocated-9.reserve failed: TypeError: ")
        got = collect(rank, ["via-ray", "via-socket"])
        assert got["via-socket"] == got["via-ray"]
        assert got["via-ray"][1] == "length" and len(got["via-ray"][0]) == 6
        host, port, _ = rank.open_calls()
    finally:
        rank.shutdown()
    with pytest.raises(OSError):
        socket.create_connection((host, port), timeout=2).close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
            t.name.startswith("colocated-9-calls") for t in threading.enumerate()):
        time.sleep(0.02)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("colocated-9-calls")]
    with pytest.raises(RuntimeError, match="call server is closed"):
        rank.open_calls()
