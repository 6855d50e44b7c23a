"""One line of an error's text, for messages and logs that quote a caught exception.

On the ground floor so every package can import it; unwrapping a framework's wrapper (Ray's
``RayTaskError``) is the caller's business.
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
