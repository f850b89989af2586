"""Character vocabulary: encode text to token ids and back, with errors that name the problem."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class UnknownCharacterError(ValueError):
    """Raised when text contains characters outside the vocabulary."""

    def __init__(self, text: str, unknown: list[tuple[int, str]]):
        self.unknown = unknown
        shown = ", ".join(f"{c!r} at position {i}" for i, c in unknown[:10])
        more = f" (and {len(unknown) - 10} more)" if len(unknown) > 10 else ""
        super().__init__(f"text contains characters outside the vocabulary: {shown}{more}")


class Vocab:
    """The model's characters in index order."""

    def __init__(self, chars: str | Sequence[str]):
        chars = "".join(chars)
        if not chars:
            raise ValueError("vocabulary is empty")
        if len(set(chars)) != len(chars):
            dup = sorted({c for c in chars if chars.count(c) > 1})
            raise ValueError(f"vocabulary repeats characters: {dup!r}")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def __repr__(self) -> str:
        return f"Vocab({len(self)} characters)"

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int32) of ``text``; raises :class:`UnknownCharacterError` naming each bad character."""
        unknown = [(i, c) for i, c in enumerate(text) if c not in self.stoi]
        if unknown:
            raise UnknownCharacterError(text, unknown)
        return np.fromiter((self.stoi[c] for c in text), dtype=np.int32, count=len(text))

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise ValueError(f"token ids must lie in [0, {len(self)}), got min {ids.min()} max {ids.max()}")
        return "".join(self.chars[i] for i in ids.tolist())
