"""The address of one decode rank on the KV data plane (torch-free: control-plane messages
carry it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVPeer:
    """Data-plane endpoint of one decode rank: where prefill ranks connect to send KV.

    The decode rank publishes it (``DecodeKVConnector.address`` plus its identity); the
    reservation carries one per decode rank, in rank order, to the prefill connector.

    Attributes:
        instance: decode instance name, e.g. "decode-0".
        rank: TP rank inside that instance.
        host, port: address of the rank's rendezvous store.
    """

    instance: str
    rank: int
    host: str
    port: int
