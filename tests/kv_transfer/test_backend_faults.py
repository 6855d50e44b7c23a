"""Fault isolation per pair backend, with fake NCCL/HCCL group classes (no device here):
the error-handling environment and options each backend's groups are made with, and the
abort of a failed pair (kv_transfer/backend.py COMM_SETTINGS)."""

import datetime
import os
import threading

import pytest
import torch

from kv_transfer.backend import COMM_SETTINGS, MB, PairBackend, backend_for, device_backend
from kv_transfer.errors import TransferError
from kv_transfer.pair import PairGroup
from kv_transfer.sender import SenderChannel


class FakeGroup:
    """Stands for ProcessGroupNCCL / ProcessGroupHCCL: records the environment and options
    it was constructed with, fails its sends, counts aborts."""

    made: list["FakeGroup"] = []

    class Options:
        _timeout = None

    def __init__(self, store, rank, size, opts):
        self.rank, self.size, self.opts = rank, size, opts
        self.env = dict(os.environ)
        self.aborts = 0
        FakeGroup.made.append(self)

    def send(self, tensors, dst, tag):
        raise RuntimeError("NCCL communicator was aborted: peer gone")

    def abort(self):
        self.aborts += 1


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    for settings in COMM_SETTINGS.values():
        for key in settings.env:
            monkeypatch.delenv(key, raising=False)
    FakeGroup.made.clear()


@pytest.mark.parametrize("name,handling_key", [("nccl", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
                                               ("hccl", "HCCL_ASYNC_ERROR_HANDLING")])
def test_device_groups_are_made_with_cleanup_only_error_handling(name, handling_key):
    backend = device_backend(name, FakeGroup)
    group = backend.make_group(object(), 1, 7.5, "10.0.0.1")
    assert (group.rank, group.size) == (1, 2)
    assert group.opts._timeout == datetime.timedelta(seconds=7.5)
    # the default (tear the process down) would kill the peer's rank with the pair
    assert group.env[handling_key] == "2"
    if name == "nccl":
        assert group.env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    else:  # a pair's own HCCL buffer, not 2 x HCCL_BUFFSIZE (400 MB) per pair
        assert group.opts.hccl_config == {"hccl_buffer_size": 16}
    assert backend.settings is COMM_SETTINGS[name]


def test_settings_table_names_buffers_and_abort_per_backend():
    assert COMM_SETTINGS["hccl"].buffer_bytes == 400 * MB  # 2 x HCCL_BUFFSIZE (200 MB)
    assert COMM_SETTINGS["hccl"].pair_buffer_bytes == 2 * 16 * MB
    assert COMM_SETTINGS["nccl"].buffer_bytes > COMM_SETTINGS["nccl"].pair_buffer_bytes > 0
    assert COMM_SETTINGS["gloo"].buffer_bytes == 0 and COMM_SETTINGS["gloo"].env == {}
    assert COMM_SETTINGS["gloo"].abort_method is None
    assert {COMM_SETTINGS[n].abort_method for n in ("nccl", "hccl")} == {"abort"}


def test_gloo_groups_keep_the_process_environment():
    before = dict(os.environ)
    backend = backend_for("cpu")
    assert backend.name == "gloo" and backend.settings is COMM_SETTINGS["gloo"]
    assert dict(os.environ) == before


def _pair(backend: PairBackend) -> PairGroup:
    group = backend.make_group(object(), 0, 1.0, "127.0.0.1")
    return PairGroup("prefill p/0 -> decode d/0 gen 1", group, store=None, prefix="p",
                     generation=1, rank=0, backend=backend, peer_layout={})


def test_a_failed_device_pair_raises_a_transfer_error_and_aborts_only_its_group():
    backend = device_backend("nccl", FakeGroup)
    failed, other = _pair(backend), _pair(backend)
    with pytest.raises(TransferError, match="gen 1: data record failed"):
        failed.post([torch.zeros(2)], "data record")
    failed.abort()
    assert (failed.group.aborts, other.group.aborts) == (1, 0)


def test_an_abort_that_raises_is_logged_not_raised(caplog):
    backend = device_backend("hccl", FakeGroup)
    pair = _pair(backend)
    pair.group.abort = lambda: (_ for _ in ()).throw(RuntimeError("already destroyed"))
    pair.abort()
    assert "abort failed" in caplog.text


class _Owner:
    def __init__(self):
        self.failed = {}

    def fail(self, request_id, error):
        self.failed[request_id] = error


def test_sender_teardown_aborts_the_pair_and_fails_only_its_requests():
    """The sender thread's teardown (any pair error) aborts the communicator before it drops
    the pair; only the requests with records on it fail."""
    channel = SenderChannel.__new__(SenderChannel)  # NOTE: no thread: the teardown alone
    pair = _pair(device_backend("nccl", FakeGroup))
    owner = _Owner()
    channel._pair, channel._owner, channel._active = pair, owner, {"a", "b"}
    channel._aborted, channel._pair_peer, channel._mismatch, channel._link = {}, None, None, None
    channel._teardown(TransferError("peer died", pair=pair.name))
    assert pair.group.aborts == 1
    assert set(owner.failed) == {"a", "b"} and channel._pair is None


def test_a_same_node_pair_signals_over_gloo_never_a_device_communicator():
    """Two ranks on one GPU: NCCL refuses them, and the group only carries ready/ack."""
    from kv_transfer.pair import group_backend

    nccl = device_backend("nccl", FakeGroup)
    assert group_backend(nccl, same_node=True).name == "gloo"
    assert group_backend(nccl, same_node=False) is nccl
    gloo = backend_for("cpu")
    assert group_backend(gloo, same_node=True) is gloo


def test_a_silent_peer_s_receiver_aborts_its_group_a_closing_one_does_not():
    """Decode side: a pair given up for a dead or hung prefill rank aborts its communicator
    (a hung NCCL peer would otherwise hold the watchdog); a normal close only wakes it."""
    from kv_transfer.receiver import ReceiverChannel

    class Store:
        def __init__(self):
            self.keys = []

        def set(self, key, value):
            self.keys.append(key)

    for abort in (True, False):
        channel = ReceiverChannel.__new__(ReceiverChannel)  # NOTE: no thread: stop alone
        channel._stop, channel._group = threading.Event(), _pair(device_backend("nccl",
                                                                               FakeGroup))
        store = Store()
        channel.stop(store, abort=abort)
        assert channel._group.group.aborts == int(abort)
        assert channel._stop.is_set() and store.keys == ["p/doorbell/1"]  # woken either way
