"""Errors told apart by type (and by the clock for gloo), never by their text; the package
root imports no torch."""

import datetime
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from kv_transfer.backend import backend_for
from kv_transfer.config import TransferConfig
from kv_transfer.errors import TransferError, TransferTimeout
from kv_transfer.pair import PairGroup, connect


class _FailingWork:
    """A ``dist.Work`` whose wait raises ``RuntimeError(text)`` after ``delay_s``."""

    def __init__(self, text: str, delay_s: float) -> None:
        self.text, self.delay_s = text, delay_s

    def wait(self, timeout: datetime.timedelta) -> None:
        time.sleep(self.delay_s)
        raise RuntimeError(self.text)


def test_gloo_wait_tells_timeout_from_peer_error_by_the_clock_not_the_text():
    wait = backend_for("cpu").wait
    # a failure that used up the whole bound is a timeout, whatever gloo's wording
    with pytest.raises(TransferTimeout, match="no progress within 0.2 s"):
        wait(_FailingWork("recv operation did not complete", delay_s=0.25), 0.2)
    # a failure before the bound is the backend's own error, even if its text says "Timed out"
    with pytest.raises(RuntimeError, match="Timed out") as caught:
        wait(_FailingWork("Timed out connecting: peer closed", delay_s=0.0), 5.0)
    assert not isinstance(caught.value, TransferError)


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def _gloo_pair(port: int) -> list[dist.ProcessGroup]:
    """Both ranks of a gloo pair group, built in this process (a store client each)."""
    groups = [None, None]

    def make(rank: int) -> None:
        groups[rank] = backend_for("cpu").make_group(dist.PrefixStore("pg", _client(port)),
                                                     rank, 30.0, "127.0.0.1")
    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


def test_real_gloo_timeout_is_a_transfer_timeout_naming_the_pair():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    _, decode_group = _gloo_pair(server.port)
    assert decode_group is not None
    pair = PairGroup("prefill p/0 -> decode d/0 gen 1", decode_group, server, "pair/p/0/1",
                     generation=1, rank=1, backend=backend_for("cpu"), peer_layout={})
    with pytest.raises(TransferTimeout) as caught:
        pair.recv_all([torch.zeros(4)], 0.3, "data record of request r")
    name = "prefill p/0 -> decode d/0 gen 1"
    assert caught.value.pair == name
    assert str(caught.value).startswith(f"{name}: data record of request r: no progress")


def test_idle_doorbell_wait_survives_store_timeouts_and_ends_when_the_store_dies():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    client = _client(server.port)
    client.set_timeout(datetime.timedelta(seconds=0.1))  # NOTE: several get() timeouts below
    pair = PairGroup("p -> d gen 1", None, client, "pair/p/0/1", 1, 1, backend_for("cpu"), {})
    later = threading.Timer(0.6, _client(server.port).set,
                            args=("pair/p/0/1/doorbell/1", b"header"))
    later.start()
    assert pair.wait_doorbell(threading.Event()) == b"header"
    assert pair.doorbells == 1
    del server  # the store server goes away: the wait ends with the store's network error
    with pytest.raises(dist.DistNetworkError):
        pair.wait_doorbell(threading.Event())


def test_package_root_imports_no_torch():
    """Control-plane messages import KVPeer / TransferConfig / errors without torch."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import kv_transfer\n"
            "from kv_transfer import KVPeer, TransferConfig, TransferError, TransferTimeout\n"
            "assert KVPeer('d', 0, 'h', 1).port == 1 and TransferConfig().poll_interval_s > 0\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_malformed_ack_fails_the_connect_naming_the_pair():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))

    def bad_decode_rank() -> None:  # answers the first announce with bytes that are no Ack
        server.wait(["announce/1"])
        server.set("pair/p0/0/1/ack", b"\xc1")
    answer = threading.Thread(target=bad_decode_rank)
    answer.start()
    with pytest.raises(TransferError) as caught:
        connect("127.0.0.1", server.port, "p0", 0, "d0/0", {}, backend_for("cpu"),
                TransferConfig(connect_timeout_s=10), torch.device("cpu"))
    answer.join()
    where = f"prefill p0/0 -> decode d0/0 at 127.0.0.1:{server.port}"
    assert caught.value.pair == where and not isinstance(caught.value, TransferTimeout)
    assert str(caught.value).startswith(f"{where}: malformed Ack")
