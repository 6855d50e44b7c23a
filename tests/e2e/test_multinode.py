"""Prefill and decode on different Ray nodes (ray.cluster_utils.Cluster: one head and two
labelled worker nodes on this machine); `orch up` joins it and outputs still equal colocated."""

from __future__ import annotations

import pytest

from tests.e2e.harness import REPO, OrchProcess, wait_idle
from tests.e2e.conftest import MAX_TOKENS

NUM_REQUESTS = 4


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1",
                                      "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, resources={"prefill_node": 1},
                         node_ip_address="127.0.0.1")
        cluster.add_node(num_cpus=2, resources={"decode_node": 1},
                         node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def test_prefill_and_decode_on_different_nodes(two_node_cluster, tmp_path, prompts,
                                               colocated_outputs):
    overrides = {"cluster.address": two_node_cluster.address, "cluster.bind_host": "127.0.0.1",
                 "prefill.ray_resources": {"prefill_node": 0.01},
                 "decode.ray_resources": {"decode_node": 0.01}}
    with OrchProcess(REPO / "configs" / "hetero_tp_1p1d.yaml", tmp_path, overrides) as orch:
        status = orch.status()
        nodes = {i.role: {r.node_id for r in i.ranks} for i in status.instances}
        assert len(nodes["prefill"]) == 1 and len(nodes["decode"]) == 1
        assert nodes["prefill"] != nodes["decode"], nodes
        outputs = orch.generate_many(prompts[:NUM_REQUESTS], max_tokens=MAX_TOKENS)
        assert outputs == colocated_outputs[:NUM_REQUESTS]
        wait_idle(orch)
