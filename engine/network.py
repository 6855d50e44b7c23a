"""Which local address a rank's Gloo sockets use (TP groups and KV pair groups).

NOTE: orch never lets Gloo guess from the hostname, which often resolves to loopback
(``127.0.1.1 <hostname>``) and breaks groups across hosts ("Gloo connectFullMesh failed ...
remote=[127.0.0.1]"). A group's device is bound to the interfaces ``GLOO_SOCKET_IFNAME`` names
(comma separated) when set, else to the local address the kernel sends from to reach the
peer's rendezvous address (:func:`local_address_toward`).
"""

from __future__ import annotations

import fcntl
import socket
import struct

import torch.distributed as dist

from engine import envs

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's (primary) IPv4 address
_DISCARD_PORT = 9  # any port: connecting a UDP socket sends nothing


def local_address_toward(host: str) -> str:
    """The local IP this host sends from to reach ``host`` (IPv4 or IPv6 text).

    Only the routing table is consulted (no packet leaves); a loopback ``host`` gives
    ``127.0.0.1`` (``::1``).

    Raises:
        OSError: ``host`` does not resolve or no route leads to it (message names it).
    """
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, _DISCARD_PORT, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.connect(sockaddr)
            return sock.getsockname()[0]
    except OSError as exc:
        raise OSError(f"no local address reaches {host!r} ({exc}): check that the peer's "
                      "address resolves and is routable from this host, or set "
                      "GLOO_SOCKET_IFNAME to the interface to use") from None


def interface_of(address: str) -> str:
    """The name of the network interface whose IPv4 address is ``address`` (Linux).

    Raises:
        OSError: no interface has that address as its primary IPv4 address (an IPv6 or a
            secondary address): set GLOO_SOCKET_IFNAME to the interface instead.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # NOTE: an interface without an IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    raise OSError(f"no network interface has the address {address}: set GLOO_SOCKET_IFNAME "
                  "to the interface Gloo should use")


def gloo_devices(peer_host: str) -> list[dist.ProcessGroupGloo.Device]:
    """Gloo devices of a group whose rendezvous address is ``peer_host`` (see module doc).

    Raises:
        OSError: as :func:`local_address_toward`.
        RuntimeError: Gloo cannot use an interface ``GLOO_SOCKET_IFNAME`` names.
    """
    create = dist.ProcessGroupGloo.create_device
    names = [name.strip() for name in envs.GLOO_SOCKET_IFNAME.get().split(",") if name.strip()]
    if names:
        return [create(interface=name) for name in names]
    return [create(hostname=local_address_toward(peer_host))]


def set_gloo_interface_default(peer_host: str) -> None:
    """Point ``GLOO_SOCKET_IFNAME`` (of this process) at the interface that reaches
    ``peer_host``, unless it is set: for groups torch builds itself
    (``init_process_group``), which read only that variable.

    Raises:
        OSError: as :func:`local_address_toward` and :func:`interface_of`.
    """
    if not envs.GLOO_SOCKET_IFNAME.get():
        envs.GLOO_SOCKET_IFNAME.set_default(interface_of(local_address_toward(peer_host)))
