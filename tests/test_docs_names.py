"""docs/request_path.md names real things: every file it cites exists, and every code name it
cites (``Router._open``, ``ReservedRequest``, ``Phase.DECODING``) is defined or used in the
files of the same table row (in the packages, for prose outside a table)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "request_path.md"
PACKAGES = ("engine", "kv_transfer", "rank", "prefill_worker", "decode_worker", "orchestrator")
TICKED = re.compile(r"`([^`]+)`")
FILE = re.compile(r"^[\w/.-]+\.(py|proto|yaml|md)$")
# a code name: dotted identifiers, optionally called: Router._open, KVPoll.SUCCESS, run_step(...)
NAME = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(\(.*\))?$")


def cited(text: str) -> tuple[list[str], list[str]]:
    """(file paths, code names) in the backticks of ``text``; a code name is kept when it
    looks like code (a dot, an underscore, a capital, or a call), not a plain word."""
    files, names = [], []
    for tick in TICKED.findall(text):
        if FILE.match(tick):
            files.append(tick)
            continue
        m = NAME.match(tick)
        if m and (m.group(2) or re.search(r"[._A-Z]", m.group(1))):
            names.append(m.group(1))
    return files, names


def missing_names(names: list[str], sources: str) -> list[str]:
    """The names of which some dotted part is no word of ``sources``."""
    words = set(re.findall(r"[A-Za-z_]\w*", sources))
    return [n for n in names if not all(part in words for part in n.split("."))]


def _package_text() -> str:
    return "\n".join(p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_every_cited_file_exists_and_every_name_is_in_its_row():
    problems, everything = [], None
    for n, line in enumerate(DOC.read_text().splitlines(), 1):
        files, names = cited(line)
        problems += [f"line {n}: no file {f}" for f in files
                     if "/" in f and not (ROOT / f).exists()]
        if not names:
            continue
        here = [ROOT / f for f in files if (ROOT / f).is_file()]
        if here:
            text = "\n".join(p.read_text() for p in here)
        else:
            everything = everything if everything is not None else _package_text()
            text = everything
        problems += [f"line {n}: {name} not found in {[str(p.relative_to(ROOT)) for p in here] or 'the packages'}"
                     for name in missing_names(names, text)]
    assert not problems, "\n".join(problems)


def test_the_checker_reports_a_name_or_file_that_does_not_exist():
    files, names = cited("| x | `NoSuchThing.here` and `Router._open` | `orchestrator/nope.py` |")
    assert files == ["orchestrator/nope.py"] and names == ["NoSuchThing.here", "Router._open"]
    assert missing_names(names, "class Router:\n    def _open(self): ...") == ["NoSuchThing.here"]
