"""A request's output as it is generated: the engine's rows read back step by step and handed out
as deltas of tokens, text and log-probabilities (:class:`RequestStream`), and the stop-string
check on a subword row's text (:class:`StopWatch`). See :mod:`jaxdecode.serving.engine`.

Text is handed out in whole characters: a subword vocabulary may split a multi-byte character
over several tokens, and its bytes are held back until it is whole. What a stream has handed out
is always a prefix of the finished row's text (:meth:`Engine.output`), so the deltas of a sample
concatenate to exactly that text.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxdecode.decoding.common import is_subword

REPLACEMENT = "\ufffd"


def _whole(text: str) -> int:
    """The length of ``text`` without a trailing split character (decoded as U+FFFD)."""
    end = len(text)
    while end and text[end - 1] == REPLACEMENT:
        end -= 1
    return end


class StopWatch:
    """Whether a subword row's text has completed one of its stop strings, however the model
    spelled it: after each token, the text of its last tokens is searched (a stop string of ``b``
    UTF-8 bytes that ends in the newest token lies within its last ``b + 4`` tokens, since every
    token of a byte-level vocabulary holds at least one byte). The first step whose text holds a
    stop string is the one that completes it, so the search needs no memory of earlier hits."""

    def __init__(self, vocab, stops: list[str]):
        self.vocab, self.stops = vocab, list(stops)
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + 4
        self.ids: list[int] = []

    def push(self, token: int) -> bool:
        self.ids.append(int(token))
        tail = self.vocab.decode(self.ids[-self.window:])
        return any(s in tail for s in self.stops)


def stop_watch(lm, stops: list[str]) -> StopWatch | None:
    """A :class:`StopWatch` for a subword model's row with stop strings; None where the token
    sequences suffice (a character vocabulary spells every string one way)."""
    return StopWatch(lm.vocab, stops) if stops and is_subword(lm.vocab) else None


class Delta(NamedTuple):
    """What one sample of a request added since the last :meth:`RequestStream.poll`.

    ``tokens``, ``logprobs`` (the model's log-probability of each, before any rule) and
    ``top_logprobs`` (per token, the request's ``top_logprobs`` most probable ``(token, logprob)``
    pairs, or None) run together; end tokens are not text and are left out of them. ``text`` is
    new whole characters. ``finish_reason`` is None while the sample runs, then ``"length"``,
    ``"stop"`` (a stop string), ``"eos"`` (an end token) or ``"abort"``. ``generated``: tokens the
    sample has generated in all (end tokens included)."""

    sample: int
    text: str
    tokens: list
    logprobs: list
    top_logprobs: list | None
    finish_reason: str | None
    generated: int


class RequestStream:
    """The deltas of request ``index`` of ``engine`` (:meth:`Engine.stream`). ``include_stop``: keep
    a stop string that ends a sample in its text (the library's default) or cut it (as OpenAI's
    API does); text that could still turn out to begin a stop string is held back until it is
    known not to."""

    def __init__(self, engine, index: int, include_stop: bool = True):
        self.engine, self.index, self.include_stop = engine, index, include_stop
        self.rows = engine.rows(index)
        request = engine.requests[index]
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        self.hold = 0 if include_stop or not stops else max(len(s) for s in stops) - 1
        self.vocab = engine.lm.vocab
        self.eos = set(getattr(engine.lm, "eos_ids", ()))
        self.sent_tokens = [0] * len(self.rows)  # tokens handed out (end tokens skipped)
        self.sent_text = [0] * len(self.rows)  # characters handed out
        self.done = [False] * len(self.rows)
        # per sample: the text of its first tokens, known to end on a whole character, and how many
        # tokens that covers (so a poll decodes only the tokens after it, not the whole row again)
        self.settled_text = [""] * len(self.rows)
        self.settled = [0] * len(self.rows)

    @property
    def finished(self) -> bool:
        return all(self.done)

    def poll(self) -> list[Delta]:
        """The samples that changed since the last poll (each at most once)."""
        out = []
        for j, row in enumerate(self.rows):
            if self.done[j]:
                continue
            if row.finish is None:
                if len(row.tokens) == self.sent_tokens[j]:
                    continue  # nothing new (a row in line, or one whose tokens are still on their way)
                tokens = row.tokens[:]
                text = self._text_of(j, tokens)
                end = max(self.sent_text[j], _whole(text) - self.hold)
                delta = self._delta(j, row, tokens, text[:end], None)
            else:
                self.done[j] = True
                g = self.engine.output(self.index, j, include_stop=self.include_stop)
                delta = self._delta(j, row, list(np.asarray(g.tokens).tolist()), g.text, g.finish_reason)
            if delta is not None:
                out.append(delta)
        return out

    def _text_of(self, j: int, tokens: list) -> str:
        """The text of a running sample's tokens (end tokens are not text), decoding only the tokens
        after the last point where its text ended on a whole character."""
        tail = [t for t in tokens[self.settled[j]:] if t not in self.eos]
        text = self.vocab.decode(tail) if tail else ""
        if _whole(text) == len(text):
            self.settled_text[j] += text
            self.settled[j] = len(tokens)
            return self.settled_text[j]
        return self.settled_text[j] + text

    def _delta(self, j, row, tokens, text, finish) -> Delta | None:
        new_text = text[self.sent_text[j]:]
        self.sent_text[j] = max(self.sent_text[j], len(text))
        sent = self.sent_tokens[j]
        idx = [i for i in range(sent, len(tokens)) if tokens[i] not in self.eos] if self.eos \
            else range(sent, len(tokens))
        self.sent_tokens[j] = max(sent, len(tokens))
        if not new_text and not idx and finish is None:
            return None
        top = None
        if getattr(row, "top_k", 0):
            top = [list(zip(row.top[i][0][:row.top_k].tolist(), row.top[i][1][:row.top_k].tolist()))
                   for i in idx if i < len(row.top)]
        return Delta(j, new_text, [tokens[i] for i in idx], [row.mlp[i] for i in idx], top, finish,
                     len(row.tokens))
