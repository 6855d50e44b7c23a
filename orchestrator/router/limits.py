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


def check_request_size(nbytes: int, limit: int, max_model_len: int) -> None:
    """Refuse a serialized request over ``limit`` bytes (:func:`max_request_bytes`).

    Raises:
        RequestError: INVALID_ARGUMENT naming the sizes and what to do.
    """
    if nbytes > limit:
        raise RequestError("INVALID_ARGUMENT",
                           f"request is {nbytes} bytes; with max_model_len {max_model_len} "
                           f"a request can use at most {limit} bytes: shorten the prompt "
                           "(or raise model.max_model_len)")
