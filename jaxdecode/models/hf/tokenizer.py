"""A Hugging Face ``tokenizer.json`` as a jaxdecode vocabulary, through the ``tokenizers`` library.

:class:`HFTokenizer` offers what the loops and the command line use of a vocabulary: ``encode``
(with the tokenizer's own special tokens, e.g. a Llama BOS), ``decode``, ``len`` (the model's
vocabulary size, which may exceed the tokenizer's: ids past it decode to nothing), and
``token_bytes(i)``, the bytes a token stands for (byte-level BPE tokens mapped back through
GPT-2's byte alphabet), which constrained generation matches patterns against.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxdecode.io.vocab import checked_ids


class TokenizerError(ValueError):
    """A folder's tokenizer is missing or cannot be read."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class HFTokenizer:
    """The ``tokenizers`` library's tokenizer of a model folder, sized to the model's ``V``."""

    def __init__(self, path: str | Path, V: int | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - a dependency
            raise TokenizerError("reading tokenizer.json needs the tokenizers package: "
                                 "pip install tokenizers") from None
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"{path.parent}: no tokenizer.json (the folder needs its tokenizer)")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception
            raise TokenizerError(f"{path}: not a tokenizer the tokenizers library can read ({e})") from None
        self.path = path
        self.size = self.tok.get_vocab_size(with_added_tokens=True)
        self.V = self.size if V is None else V
        if self.size > self.V:
            raise TokenizerError(f"{path}: the tokenizer has {self.size} tokens, more than the model's "
                                 f"{self.V} (vocab_size in config.json: the embedding has a row per token)")
        self._bytes: list[bytes] | None = None
        added = self.tok.get_added_tokens_decoder()
        self.special = {i for i, t in added.items() if t.special}

    def __len__(self) -> int:
        return self.V

    def __repr__(self) -> str:
        return f"HFTokenizer({self.size} tokens, model vocabulary {self.V})"

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=add_special_tokens).ids, np.int32)

    subword = True  # stop strings are matched on the decoded text, not on token sequences

    def encode_piece(self, text: str) -> np.ndarray:
        """``text``'s ids without special tokens (a piece of text inside a sequence: a stop string)."""
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        """The text of ``ids`` as a continuation: a tokenizer whose decoder strips the first
        token's leading space (sentencepiece-style "▁" vocabularies) keeps it here, because the
        ids follow a prompt (decoded after an anchor token, then the anchor's text cut off)."""
        ids = checked_ids(ids, self.V)
        if ids and max(ids) >= self.size:  # the model's padding ids past the tokenizer's are not text
            ids = [i for i in ids if i < self.size]
        if not ids:
            return ""
        anchor, anchor_text = self._anchor()
        if anchor is None:
            return self.tok.decode(ids, skip_special_tokens=False)
        text = self.tok.decode([anchor] + ids, skip_special_tokens=False)
        if text.startswith(anchor_text):
            return text[len(anchor_text):]
        return self.tok.decode(ids, skip_special_tokens=False)

    def _anchor(self):
        """A plain token to decode continuations after, and its text alone (cached)."""
        if not hasattr(self, "_anchor_cache"):
            found = (None, "")
            for piece in ("a", "e", ".", "0"):
                ids = self.tok.encode(piece, add_special_tokens=False).ids
                if len(ids) == 1:
                    text = self.tok.decode(ids, skip_special_tokens=False)
                    if text:
                        found = (ids[0], text)
                        break
            self._anchor_cache = found
        return self._anchor_cache

    def token_text(self, i: int) -> str:
        """The token's string as the vocabulary stores it (e.g. ``"Ġthe"``)."""
        t = self.tok.id_to_token(int(i)) if i < self.size else None
        return "" if t is None else t

    @property
    def chars(self) -> tuple[str, ...]:
        """Each token's text, decoded alone (partial characters as U+FFFD)."""
        return tuple(self.token_bytes(i).decode("utf-8", errors="replace") for i in range(self.V))

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for in generated text (b"" for ids past the tokenizer's)."""
        if self._bytes is None:
            self._bytes = self._all_bytes()
        return self._bytes[int(i)]

    def _all_bytes(self) -> list[bytes]:
        table = _byte_decoder()
        vocab = self.tok.get_vocab(with_added_tokens=True)
        out = [b""] * self.V
        for token, i in vocab.items():
            if i >= self.V:
                continue
            if i in self.special:
                out[i] = token.encode("utf-8")
            elif all(c in table for c in token):  # byte-level BPE
                out[i] = bytes(table[c] for c in token)
            elif token.startswith("<0x") and token.endswith(">") and len(token) == 6:  # sentencepiece byte
                out[i] = bytes([int(token[3:5], 16)])
            else:  # a metaspace vocabulary: "▁" is a space
                out[i] = token.replace("\u2581", " ").encode("utf-8")
        return out
