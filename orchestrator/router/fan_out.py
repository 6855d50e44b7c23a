"""``n`` choices of one prompt: n router requests (choice i seeded ``seed + i``) whose
streams are merged as they come. gRPC (``api/server.py``) and HTTP (``api/http/``) both use it.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import AsyncIterator, TypeVar

from orchestrator.router.request import GenerateInput, RequestError

MAX_CHOICES = 16
T = TypeVar("T")


def choice_inputs(inp: GenerateInput, n: int) -> list[GenerateInput]:
    """The ``n`` requests of ``inp``: choice i has seed ``seed + i`` (an unset seed stays
    unset: each choice draws its own) and id ``"<request_id>:<i>"`` (n == 1: ``inp`` itself;
    an empty id stays empty: the router makes one per choice).

    Raises:
        RequestError: INVALID_ARGUMENT when ``n`` is outside [1, MAX_CHOICES] or a choice's
            seed is out of range.
    """
    if not 1 <= n <= MAX_CHOICES:
        raise RequestError("INVALID_ARGUMENT", f"n is {n}: ask for 1 to {MAX_CHOICES} "
                                               "choices (send more requests for more)")
    if n == 1:
        return [inp]
    seed = inp.sampling.seed
    try:
        return [replace(inp, sampling=replace(inp.sampling,
                                              seed=None if seed is None else seed + i),
                        request_id=f"{inp.request_id}:{i}" if inp.request_id else "")
                for i in range(n)]
    except ValueError as exc:  # NOTE: seed + i past SamplingParams' range
        raise RequestError("INVALID_ARGUMENT", f"sampling: {exc} (choice seeds are seed + i: "
                                               "lower the seed)") from None


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(stream index, item) of every stream as items come, each stream in order. The first
    error of any stream ends the merge with that error; leaving (an error, the consumer
    gone) closes every stream (which aborts their router requests)."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))
            return
        await queue.put((index, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            index, item = await queue.get()
            if item is done:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]
