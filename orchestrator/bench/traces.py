"""Readers for the public request traces: one :class:`TraceEntry` per request, as recorded.

Formats (../shared/data/README.md): Mooncake JSONL (FAST'25: ``timestamp`` ms,
``input_length``, ``output_length``, ``hash_ids`` one per 512-token prompt block, equal leading
ids = shared prefix); Azure LLM inference CSV (Splitwise, ISCA'24: ``TIMESTAMP`` absolute with
7 fraction digits, ``ContextTokens``, ``GeneratedTokens``); ShareGPT JSON (first ``human``
turn is the prompt; no output length, no time). Readers never cap, scale or re-time:
:mod:`.workloads` does, so a replay compares with the file line by line.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceEntry:
    """One request of a trace, unchanged.

    Attributes:
        arrival_s: seconds from the first request of the file (None when the trace has no
            times, as ShareGPT).
        input_len: prompt tokens (None for a text prompt whose length is not known yet).
        output_len: tokens to generate (None when the trace has none, as ShareGPT).
        hash_ids: Mooncake prefix-block ids (``MOONCAKE_BLOCK_TOKENS`` tokens each), else ().
        text: prompt text for text traces, else None.
    """

    arrival_s: float | None
    input_len: int | None
    output_len: int | None
    hash_ids: tuple[int, ...] = ()
    text: str | None = None


def _open_checked(path: Path, what: str):
    if not path.is_file():
        raise FileNotFoundError(
            f"{what} trace {path} not found: pass --trace PATH (the public files live in "
            f"../shared/data, see its README.md)")
    return path.open("r", encoding="utf-8")


def read_mooncake(path: str | Path) -> list[TraceEntry]:
    """Read a Mooncake JSONL trace; ``timestamp`` ms -> ``arrival_s`` seconds from the first.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not a Mooncake record (the line number is in the message).
    """
    entries: list[TraceEntry] = []
    with _open_checked(Path(path), "Mooncake") as f:
        t0: float | None = None
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ts = float(rec["timestamp"]) / 1000.0
                t0 = ts if t0 is None else t0
                entries.append(TraceEntry(
                    arrival_s=ts - t0, input_len=int(rec["input_length"]),
                    output_len=int(rec["output_length"]),
                    hash_ids=tuple(int(h) for h in rec.get("hash_ids", ()))))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record "
                                 f"(timestamp, input_length, output_length, hash_ids): {e}")
    return entries


def parse_azure_timestamp(text: str) -> float:
    """Seconds since the epoch (naive, UTC assumed) of an Azure trace ``TIMESTAMP``; the
    7+-digit fraction is read apart (``"...:46.6805900"`` -> ``... + 0.68059``).

    Raises:
        ValueError: not ``YYYY-MM-DD HH:MM:SS[.fraction]``.
    """
    whole, _, frac = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    if frac and not frac.isdigit():
        raise ValueError(f"bad fraction in Azure TIMESTAMP {text!r}")
    seconds = (base - datetime(1970, 1, 1)).total_seconds()
    return seconds + (int(frac) / 10 ** len(frac) if frac else 0.0)


def read_azure(path: str | Path) -> list[TraceEntry]:
    """Read an Azure LLM inference CSV; ``arrival_s`` is seconds from the first row.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a column is missing or a row does not parse (row number in the message).
    """
    entries: list[TraceEntry] = []
    with _open_checked(Path(path), "Azure") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not need <= set(reader.fieldnames or ()):
            raise ValueError(f"{path}: Azure trace needs columns {sorted(need)}, "
                             f"found {reader.fieldnames}")
        t0: float | None = None
        for rowno, row in enumerate(reader, 2):
            try:
                ts = parse_azure_timestamp(row["TIMESTAMP"])
                t0 = ts if t0 is None else t0
                entries.append(TraceEntry(arrival_s=ts - t0,
                                          input_len=int(row["ContextTokens"]),
                                          output_len=int(row["GeneratedTokens"])))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{rowno}: bad Azure trace row {row}: {e}")
    return entries


def read_sharegpt(path: str | Path) -> list[TraceEntry]:
    """Read a ShareGPT JSON list; one entry per conversation that has a non-empty human turn.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a JSON list of conversations.
    """
    with _open_checked(Path(path), "ShareGPT") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: ShareGPT file must be a JSON list of conversations")
    entries: list[TraceEntry] = []
    for conv in data:
        turns = conv.get("conversations", []) if isinstance(conv, dict) else []
        text = next((t.get("value") for t in turns if t.get("from") == "human"), None)
        if text:
            entries.append(TraceEntry(arrival_s=None, input_len=None, output_len=None, text=text))
    return entries
