"""Vocabularies: encode text to token ids and back, with errors that name the problem.

:class:`Vocab` has one character per token (the reference model's); :class:`TokenVocab` has string
tokens of any length, matched greedily (longest first)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def checked_ids(ids, size: int) -> list[int]:
    """``ids`` (a list of ints, or an array of any shape, flattened) as a list of Python ints, each
    checked to lie in ``[0, size)``. A list skips numpy: a stream decodes a few tokens at a time."""
    if not isinstance(ids, list):
        ids = np.asarray(ids).reshape(-1).tolist()
    if ids and (min(ids) < 0 or max(ids) >= size):
        raise ValueError(f"token ids must lie in [0, {size}), got min {min(ids)} max {max(ids)}")
    return ids


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
        return "".join([self.chars[i] for i in checked_ids(ids, len(self))])


class UncoveredTextError(UnknownCharacterError):
    """Raised when no token of a :class:`TokenVocab` matches the text at some position."""

    def __init__(self, text: str, uncovered: list[tuple[int, str]]):
        self.uncovered = uncovered
        self.unknown = [(i + j, c) for i, piece in uncovered for j, c in enumerate(piece)]
        shown = ", ".join(f"{piece!r} at position {i}" for i, piece in uncovered[:10])
        more = f" (and {len(uncovered) - 10} more)" if len(uncovered) > 10 else ""
        ValueError.__init__(self, f"no token of the vocabulary covers {shown}{more}")


class TokenVocab:
    """A vocabulary of string tokens of any length (``"t"``, ``"th"``, ``"the"``, ...), token id =
    index in ``tokens``.

    :meth:`encode` splits text by greedy longest match: at each position the longest token that
    matches there (so with ``"t"``, ``"th"`` and ``"the"``, ``"these"`` starts with ``"the"``).
    :meth:`decode` concatenates. Decoding then encoding gives back the text, not always the same
    ids (``["t", "h"]`` decodes to ``"th"``, which encodes as ``["th"]``).

    ``chars`` is the same tuple as ``tokens`` (``chars[i]`` is the text of token ``i`` for a
    :class:`Vocab` and a :class:`TokenVocab` alike), so code that prints or compares a
    vocabulary's ``chars`` works with both.
    """

    def __init__(self, tokens: Sequence[str]):
        if isinstance(tokens, str):
            raise TypeError("TokenVocab takes a sequence of token strings; for one character per "
                            "token use Vocab(chars)")
        tokens = tuple(tokens)
        if not tokens:
            raise ValueError("vocabulary is empty")
        for i, t in enumerate(tokens):
            if not isinstance(t, str) or not t:
                raise ValueError(f"token {i} must be a non-empty string, got {t!r}")
        if len(set(tokens)) != len(tokens):
            dup = sorted({t for t in tokens if tokens.count(t) > 1})
            raise ValueError(f"vocabulary repeats tokens: {dup!r}")
        self.tokens = tokens
        self.stoi = {t: i for i, t in enumerate(tokens)}
        self._longest = max(len(t) for t in tokens)
        self._lengths = sorted({len(t) for t in tokens}, reverse=True)

    @property
    def chars(self) -> tuple[str, ...]:
        return self.tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"TokenVocab({len(self)} tokens, up to {self._longest} characters)"

    def _match(self, text: str, i: int) -> int | None:
        """The id of the longest token that matches ``text`` at ``i``, or None."""
        for n in self._lengths:
            tid = self.stoi.get(text[i:i + n])
            if tid is not None:
                return tid
        return None

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int32) of ``text`` by greedy longest match; raises :class:`UncoveredTextError`
        naming each stretch of text (and its position) where no token matches."""
        ids: list[int] = []
        uncovered: list[tuple[int, str]] = []
        i = 0
        while i < len(text):
            tid = self._match(text, i)
            if tid is not None:
                ids.append(tid)
                i += len(self.tokens[tid])
                continue
            start = i
            while i < len(text) and self._match(text, i) is None:
                i += 1
            uncovered.append((start, text[start:i]))
        if uncovered:
            raise UncoveredTextError(text, uncovered)
        return np.asarray(ids, np.int32)

    def decode(self, ids) -> str:
        return "".join([self.tokens[i] for i in checked_ids(ids, len(self))])


def same_vocabulary(a, b) -> bool:
    """Whether two vocabularies give every token id the same token, as a draft model must share
    its target's: the same size and, id by id, the same bytes (``token_bytes``, a Hugging Face
    tokenizer's) or the same characters (``chars``, a character or token vocabulary's)."""
    if len(a) != len(b):
        return False
    if hasattr(a, "token_bytes") and hasattr(b, "token_bytes"):
        return all(a.token_bytes(i) == b.token_bytes(i) for i in range(len(a)))
    if not (hasattr(a, "chars") and hasattr(b, "chars")):
        return a is b
    return tuple(a.chars) == tuple(b.chars)
