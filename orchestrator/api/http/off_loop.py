"""The HTTP API's heavy per-request work (JSON parsing, schema validation, chat templating),
run off the router's event loop so that no client's body stalls other clients' streams.

:class:`OffLoop` runs such work one piece at a time on a worker thread (``asyncio.to_thread``):
more threads would only take more turns from the loop, since parsing holds the GIL. Requests
wait their turn without blocking the loop; past ``max_waiting`` waiting requests a new one is
refused with RESOURCE_EXHAUSTED (a retry later can help).

NOTE: a C call (``json.loads``, pydantic's validator) holds the GIL until it returns, thread
or not: so a chat body's message count is checked on a plain ``json.loads`` (~10 ms a MB)
before pydantic validates the messages (~30 us each), which bounds the longest hold.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, TypeVar

from pydantic import BaseModel, ValidationError

from orchestrator.api.http.openai_schema import validation_message
from orchestrator.router.request import RequestError

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
MAX_CHAT_MESSAGES = 4096  # and at most max_model_len: each message renders to >= 1 token
MAX_WAITING = 64  # requests waiting for the worker before new ones get RESOURCE_EXHAUSTED


class OffLoop:
    """Runs blocking work one call at a time on a worker thread (see the module docstring).

    Args:
        max_waiting: calls that may wait for their turn; one more is refused.
    """

    def __init__(self, max_waiting: int = MAX_WAITING) -> None:
        self.max_waiting = max_waiting
        self._turn = asyncio.Semaphore(1)
        self._waiting = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the worker thread, after the calls before it.

        Raises:
            RequestError: RESOURCE_EXHAUSTED when ``max_waiting`` calls wait already; else
                whatever ``fn`` raises.
        """
        if self._waiting >= self.max_waiting:
            raise RequestError("RESOURCE_EXHAUSTED", f"{self._waiting} requests are waiting to "
                                                     "be parsed: retry later")
        self._waiting += 1
        try:
            await self._turn.acquire()
        finally:
            self._waiting -= 1
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        # NOTE: the turn ends when the thread does, also when the caller is cancelled first
        # (a client gone): never two threads at once.
        work.add_done_callback(self._release)
        return await asyncio.shield(work)

    def _release(self, work: asyncio.Future) -> None:
        self._turn.release()
        if not work.cancelled():
            work.exception()  # NOTE: retrieved, so a cancelled caller's failure is not logged


def parse_body(body: bytes, kind: type[M], max_messages: int) -> M:
    """``kind`` from the JSON ``body`` (blocking: run through :class:`OffLoop`); a
    ``messages`` list longer than ``max_messages`` is refused before it is validated.

    Raises:
        RequestError: INVALID_ARGUMENT naming the field (too many messages, bad JSON or a
            field the schema refuses).
    """
    if "messages" in kind.model_fields:
        check_message_count(body, max_messages)
    try:
        return kind.model_validate_json(body)
    except ValidationError as exc:
        raise RequestError("INVALID_ARGUMENT", validation_message(exc)) from None


def check_message_count(body: bytes, max_messages: int) -> None:
    """Refuse a chat body whose ``messages`` has more than ``max_messages`` entries (a body
    that is not a JSON object is left to the schema, which names what is wrong)."""
    try:
        data = json.loads(body)
    except ValueError:
        return
    messages = data.get("messages") if isinstance(data, dict) else None
    if isinstance(messages, list) and len(messages) > max_messages:
        raise RequestError("INVALID_ARGUMENT",
                           f"messages has {len(messages)} entries; at most {max_messages} are "
                           "accepted (the model's context cannot hold more): send fewer "
                           "messages")
