"""A fake capture backend for the graph mode tests (decode and prefill)."""

from __future__ import annotations


class CountingCapture:
    """A capture backend that runs the forward as is (or raises) and counts calls."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.captures, self.calls = fail, 0, 0

    def __call__(self, fn):
        self.captures += 1

        def captured(*args):
            self.calls += 1
            if self.fail:
                raise RuntimeError("backend exploded")
            return fn(*args)

        return captured
