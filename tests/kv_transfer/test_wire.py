"""Wire schema: round trips and rejection of malformed headers."""

import msgpack
import pytest
import torch

from dataclasses import replace

from kv_transfer import KVChunk, wire
from kv_transfer.errors import WireError


def test_data_header_round_trip():
    """A data header carries its chunk; the source slots stay home."""
    slots = torch.tensor([5, 6, 7, 40, 2**40], dtype=torch.int64)
    chunk = KVChunk("r-1", (0, 2, 9), 10, 15, slots, heads=(2, 4), src_slots=slots + 1)
    h = replace(wire.data_header(chunk, 3, "ab" * 8), views=(0,), cuts=(0, 3))
    back = wire.decode_header(wire.encode_header(h))
    assert back == h and back.views == (0,) and back.cuts == (0, 3)
    assert (back.kind, back.request_id, back.prefill_rank) == (wire.DATA, "r-1", 3)
    assert torch.equal(back.chunk.dst_slots, slots) and back.chunk.head_range() == range(2, 4)
    assert back.chunk.src_slots is None


def test_done_and_abort_round_trip():
    done = wire.Header(kind=wire.DONE, request_id="r", prefill_rank=0, fingerprint="f",
                       num_tokens=77)
    assert wire.decode_header(wire.encode_header(done)) == done
    hidden = torch.tensor([0.5, -3.25, 1e-8], dtype=torch.float32)
    mtp = replace(done, draft_hidden=hidden.numpy().tobytes())
    back = wire.decode_header(wire.encode_header(mtp))
    assert torch.equal(torch.frombuffer(bytearray(back.draft_hidden), dtype=torch.float32),
                       hidden)
    abort = wire.Header(kind=wire.ABORT, request_id="r", prefill_rank=1, fingerprint="f",
                        error="client cancelled")
    back = wire.decode_header(wire.encode_header(abort))
    assert back.error == "client cancelled" and back.chunk is None


def _raw(**over):
    h = wire.data_header(KVChunk("r", (1,), 0, 2, torch.tensor([1, 2])), 0, "f")
    m = msgpack.unpackb(wire.encode_header(h))
    m.update(over)
    return msgpack.packb(m, use_bin_type=True)


@pytest.mark.parametrize("over,match", [
    ({"v": wire.VERSION + 1}, "schema version"),
    ({"kind": "bogus"}, "unknown record kind"),
    ({"slots": b"\x00" * 7}, "multiple of 8"),
    ({"slots": b"\x00" * 8}, "1 slots for 2 tokens"),
    ({"layers": []}, "must be non-empty"),
    ({"t1": 0}, "must be non-empty"),
    ({"views": [0], "cuts": []}, "has cuts"),
    ({"views": [0], "cuts": [1]}, "has cuts"),
    ({"views": [0], "cuts": [0, 2]}, "has cuts"),  # 2 tokens: a cut at 2 is past the end
    ({"dh": b"\x00" * 6}, "multiple of 4"),
])
def test_malformed_headers_are_rejected(over, match):
    with pytest.raises(WireError, match=match):
        wire.decode_header(_raw(**over))


def test_garbage_and_missing_fields():
    with pytest.raises(WireError, match="malformed"):
        wire.decode_header(b"\xc1\xff")
    m = msgpack.unpackb(_raw())
    del m["rid"]
    with pytest.raises(WireError, match="malformed"):
        wire.decode_header(msgpack.packb(m))


def test_handshake_messages():
    a = wire.Announce(instance="p0", rank=2, generation=5, layout={"model": "m"})
    assert wire.unpack(wire.pack(a), wire.Announce) == a
    with pytest.raises(WireError):
        wire.unpack(b"\x80", wire.Ack)
