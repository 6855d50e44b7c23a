"""engine.error_text.first_line: the one way every package quotes a caught error."""

from __future__ import annotations

from engine.error_text import LINE_LIMIT, first_line


def test_type_and_first_non_empty_line():
    assert first_line(ValueError("\n  bad value  \nTraceback (most recent call last):\n")) == \
        "ValueError: bad value"
    assert first_line(RuntimeError("one line")) == "RuntimeError: one line"


def test_empty_text_gives_the_type_alone():
    assert first_line(TimeoutError()) == "TimeoutError"
    assert first_line(KeyError("")) == "KeyError: ''"  # KeyError quotes its key
    assert first_line(OSError(" \n \n")) == "OSError"


def test_the_line_is_cut_to_the_limit_and_never_spans_lines():
    long = RuntimeError("x" * 1000 + "\nsecond")
    assert first_line(long) == "RuntimeError: " + "x" * LINE_LIMIT
    assert first_line(long, limit=10) == "RuntimeError: " + "x" * 10
    assert "\n" not in first_line(ValueError("a\r\nb"))
