"""Gloo's local address: the route to the peer or GLOO_SOCKET_IFNAME, never the hostname.

The two-host behaviour itself (hostname resolving to loopback, peers on another host) is
tests/e2e/test_two_hosts.py; these check the pieces on this host.
"""

from __future__ import annotations

import pytest

from engine import envs
from engine.network import (gloo_devices, interface_of, local_address_toward,
                            set_gloo_interface_default)


def _own_non_loopback() -> str | None:
    """This host's address on its default route (None without one)."""
    try:
        address = local_address_toward("192.0.2.1")  # TEST-NET-1: reached by the default route
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_local_address_toward_loopback_and_own_address():
    assert local_address_toward("127.0.0.1") == "127.0.0.1"
    assert local_address_toward("localhost") in ("127.0.0.1", "::1")
    own = _own_non_loopback()
    if own is not None:  # NOTE: a host with no route at all has nothing more to check
        assert local_address_toward(own) == own


def test_local_address_toward_an_unknown_name_says_what_to_do():
    with pytest.raises(OSError, match="no-such-host.invalid.*GLOO_SOCKET_IFNAME"):
        local_address_toward("no-such-host.invalid")


def test_interface_of():
    assert interface_of("127.0.0.1") == "lo"
    with pytest.raises(OSError, match="203.0.113.77: set GLOO_SOCKET_IFNAME"):
        interface_of("203.0.113.77")


def test_gloo_devices_follow_gloo_socket_ifname(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert len(gloo_devices("127.0.0.1")) == 1
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo, lo")
    assert len(gloo_devices("10.255.255.1")) == 2  # the interfaces, not the route
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(RuntimeError):
        gloo_devices("127.0.0.1")


def test_tp_groups_interface_defaults_to_the_one_reaching_the_leader(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    set_gloo_interface_default("127.0.0.1")
    assert envs.GLOO_SOCKET_IFNAME.get() == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    set_gloo_interface_default("127.0.0.1")
    assert envs.GLOO_SOCKET_IFNAME.get() == "eth7"
