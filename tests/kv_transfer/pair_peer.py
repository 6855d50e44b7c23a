"""One side of a KV pair group, run in a network namespace by test_pair_two_hosts.py.

``decode HOST PORT``: host the rendezvous store on HOST:PORT, build the group as rank 1,
receive one tensor, print its sum. ``prefill HOST PORT``: connect to that store, build the
group as rank 0, send ``arange(1024)``. Both build the group with the gloo pair backend.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from kv_transfer.backend import backend_for

TIMEOUT_S = 20.0
N = 1024


def main(role: str, host: str, port: int) -> None:
    rank = 1 if role == "decode" else 0
    store = dist.TCPStore(host, port, is_master=rank == 1, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    group = backend_for("cpu").make_group(dist.PrefixStore("pair", store), rank, TIMEOUT_S,
                                          host)
    if rank == 1:
        out = torch.zeros(N, dtype=torch.int64)
        group.recv([out], 0, 0).wait(datetime.timedelta(seconds=TIMEOUT_S))
        print(int(out.sum()), flush=True)
    else:
        group.send([torch.arange(N)], 1, 0).wait(datetime.timedelta(seconds=TIMEOUT_S))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
