"""Tokenizer of the served checkpoint and incremental detokenization for streaming.

Incremental decoding follows the prefix/read-offset scheme of vLLM and HF TGI: keep the
tokens, decode a short window ``ids[prefix:]`` and the already-emitted part
``ids[prefix:read]``, and emit the difference only when it does not end in U+FFFD, i.e. when
the last token did not stop inside a multi-byte UTF-8 character (byte-level BPE splits
characters across tokens). The concatenation of everything emitted plus :meth:`flush` equals
``decode(all ids)``.
"""

from __future__ import annotations

from pathlib import Path

_REPLACEMENT = "\ufffd"


class Tokenizer:
    """``tokenizers`` tokenizer from ``tokenizer.json`` of a checkpoint folder.

    Raises:
        FileNotFoundError: the folder has no tokenizer.json (the message says what to do).
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {path}: copy the model's tokenizer.json there, or send "
                "token ids instead of text")
        self.file = file
        self._tok = HFTokenizer.from_file(str(file))

    @property
    def max_token_bytes(self) -> int:
        """Upper bound on the UTF-8 bytes one token covers (so a text of B bytes has at least
        ``B / max_token_bytes`` tokens)."""
        if not hasattr(self, "_max_token_bytes"):
            self._max_token_bytes = max(len(t.encode()) for t in self._tok.get_vocab(True))
        return self._max_token_bytes

    def encode(self, text: str) -> list[int]:
        """Text -> token ids (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one token of the vocabulary, else None."""
        return self._tok.token_to_id(text)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (logprob entries)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text, special tokens skipped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing token stream into text pieces that never split a character.

    Usage: ``piece = d.add(new_ids)`` for each event, then ``d.flush()`` at the end.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window (left context)
        self._read = 0  # tokens whose text was already emitted

    def add(self, token_ids: tuple[int, ...] | list[int]) -> str:
        """Append tokens; return the newly stable text ("" while a character is incomplete)."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character decodes to U+FFFD, like a full decode)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        full_text = self._tok.decode(self._ids[self._prefix:])
        if not final and (full_text.endswith(_REPLACEMENT) or len(full_text) <= len(prefix_text)):
            return ""
        # NOTE: a window that starts on a character boundary decodes to prefix_text + more;
        # anything else means the window split a character: fall back to a full re-decode.
        if not full_text.startswith(prefix_text):
            emitted = self._tok.decode(self._ids[:self._read])
            full_text, prefix_text = self._tok.decode(self._ids), emitted
        piece = full_text[len(prefix_text):]
        # NOTE: the old read offset is a character boundary (text up to it was complete), so
        # it is a safe start for the next window.
        self._prefix, self._read = self._read, len(self._ids)
        return piece
