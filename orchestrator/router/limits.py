"""Limits on what a client may send, checked at the router's edge before any work is done.

Standard library only: ``convert.py`` (and so the client) imports it, and the client imports
neither torch nor Ray. Every violation is a :class:`RequestError` INVALID_ARGUMENT whose
message states the rule, so a client knows a retry cannot help.
"""

from __future__ import annotations

import re

from orchestrator.router.request import RequestError

MAX_REQUEST_ID_CHARS = 128
REQUEST_ID_RULE = (f"1 to {MAX_REQUEST_ID_CHARS} characters from A-Z a-z 0-9 . _ : - "
                   "(or empty for a router-made id)")
_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_CHARS}}}")
# NOTE: a packed int32 token id takes at most 10 bytes on the wire (negative ids are
# sign-extended to 64 bits); a text token at most ``Tokenizer.max_token_bytes``.
MAX_ID_WIRE_BYTES = 10
# Room for request_id, sampling and field tags on top of the prompt, bytes.
ENVELOPE_BYTES = 64 * 1024
# Default gRPC receive limit of the router (``router.max_message_bytes``), bytes.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def check_request_id(request_id: str, allow_empty: bool) -> None:
    """Refuse an id a client may not use (it is echoed in every streamed message and log line).

    Args:
        request_id: as received.
        allow_empty: Generate takes "" as "make one"; Abort needs the id.

    Raises:
        RequestError: INVALID_ARGUMENT stating the rule.
    """
    if request_id == "" and allow_empty:
        return
    if _REQUEST_ID.fullmatch(request_id) is None:
        shown = request_id[:40].encode("unicode_escape").decode("ascii")
        more = "..." if len(request_id) > 40 else ""
        raise RequestError("INVALID_ARGUMENT",
                           f"request_id '{shown}{more}' ({len(request_id)} chars) is not "
                           f"allowed: use {REQUEST_ID_RULE}")


def max_request_bytes(max_model_len: int, max_token_bytes: int | None) -> int:
    """The largest serialized request this model can use, bytes.

    A prompt fills at most ``max_model_len`` tokens: as text, ``max_token_bytes`` each (None:
    no tokenizer, ids only); as ids, :data:`MAX_ID_WIRE_BYTES` each. Anything longer can only
    fail validation, so the edge refuses it unparsed.
    """
    per_token = max(max_token_bytes or 0, MAX_ID_WIRE_BYTES)
    return max_model_len * per_token + ENVELOPE_BYTES


def check_request_size(nbytes: int, limit: int, max_model_len: int,
                       field: str | None = None) -> None:
    """Refuse a serialized request over ``limit`` bytes (:func:`max_request_bytes`).

    Args:
        field: the request's largest field (:func:`largest_field`), named in the message;
            None or a prompt field (``text``, ``token_ids``): the prompt is.

    Raises:
        RequestError: INVALID_ARGUMENT naming the sizes, the field and what to do.
    """
    if nbytes <= limit:
        return
    if field == "request_id":
        raise RequestError("INVALID_ARGUMENT", f"request_id is about {nbytes} bytes, far over "
                                               f"its limit: use {REQUEST_ID_RULE}")
    if field not in (None, "text", "token_ids", "prompt", "messages"):
        raise RequestError("INVALID_ARGUMENT",
                           f"request is {nbytes} bytes, most of them in {field}; a request "
                           f"can use at most {limit} bytes: send a smaller {field}")
    raise RequestError("INVALID_ARGUMENT",
                       f"request is {nbytes} bytes; with max_model_len {max_model_len} "
                       f"a request can use at most {limit} bytes: shorten the prompt "
                       "(or raise model.max_model_len)")


def largest_field(raw: bytes) -> int | None:
    """The number of the top-level protobuf field of ``raw`` that takes the most bytes, or
    None when ``raw`` is not well-formed wire format (the parser then says why).

    Reads only tags and lengths (O(fields), never the contents): cheap on a huge request.
    """
    sizes: dict[int, int] = {}
    pos, end = 0, len(raw)
    try:
        while pos < end:
            key, pos = _varint(raw, pos)
            number, wire = key >> 3, key & 7
            start = pos
            if wire == 0:
                _, pos = _varint(raw, pos)
            elif wire == 1:
                pos += 8
            elif wire == 2:
                length, pos = _varint(raw, pos)
                pos += length
            elif wire == 5:
                pos += 4
            else:
                return None
            sizes[number] = sizes.get(number, 0) + pos - start
    except IndexError:
        return None
    return max(sizes, key=sizes.__getitem__) if sizes and pos == end else None


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it) of the base-128 varint at ``pos``; IndexError past the end."""
    value, shift = 0, 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint longer than 10 bytes")
