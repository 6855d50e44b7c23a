"""Server-sent events as the OpenAI streaming API writes them: ``data: <json>\\n\\n`` per
chunk, then ``data: [DONE]\\n\\n``."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


def event(body: dict[str, Any]) -> bytes:
    """One ``data:`` event carrying ``body`` as compact JSON."""
    return b"data: " + json.dumps(body, ensure_ascii=False,
                                  separators=(",", ":")).encode() + b"\n\n"
