"""A KV pair group between two hosts whose hostnames resolve to a loopback address (as on a
stock Debian host): two network namespaces joined by a veth pair (tests/e2e/two_hosts.py).
The group forms and the tensor arrives: the Gloo device is bound to the address that reaches
the peer, not to the hostname's. Skipped, saying why, where namespaces cannot be made."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.two_hosts import ROOT, TwoHosts, unavailable_reason
from tests.kv_transfer.pair_peer import N

PORT = 29611  # inside the decode host's own namespace: nothing else listens there
WITHIN_S = 60.0


def test_pair_group_across_hosts_with_loopback_hostnames(tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"cannot simulate two hosts: {reason}")
    hosts = TwoHosts()
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env["PYTHONPATH"] = str(ROOT)
    try:
        hosts.start()
        peer = [sys.executable, "-m", "tests.kv_transfer.pair_peer"]
        decode = subprocess.Popen(hosts.b.argv([*peer, "decode", hosts.b.address, str(PORT)]),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=env, cwd=ROOT)
        hosts.run(hosts.a, [*peer, "prefill", hosts.b.address, str(PORT)], env, WITHIN_S)
        out, _ = decode.communicate(timeout=WITHIN_S)
        assert decode.returncode == 0, out
        assert out.strip().splitlines()[-1] == str(N * (N - 1) // 2), out
    finally:
        hosts.close()
