"""One line of an error's text, for messages and logs that quote a caught exception.

Every package quotes errors this way (a remote or wrapped error's text can be a whole
traceback or a coloured multi-line report); it lives here, on the ground floor, so that
each one can import it. Unwrapping a framework's wrapper (Ray's ``RayTaskError``) is the
caller's business: it passes the error it wants quoted.
"""

from __future__ import annotations

LINE_LIMIT = 300  # characters of the quoted line


def first_line(exc: BaseException, limit: int = LINE_LIMIT) -> str:
    """``"Type: first line"`` of ``exc``: its type name and the first non-empty line of
    ``str(exc)``, stripped and cut to ``limit`` characters; just ``"Type"`` when the text is
    empty. Never raises, never returns a newline."""
    line = next((s.strip() for s in str(exc).splitlines() if s.strip()), "")
    name = type(exc).__name__
    return f"{name}: {line[:limit]}" if line else name
