"""The stop-string rule written plainly, for the tests of every loop (``test_stop_strings``,
``test_hf``): a row ends at the first of a stop string in its text (the fewest tokens whose text
holds one, tried token by token) and an end token."""


def reference(lm, tokens, stops):
    """``(tokens, text, finish_reason)`` of a row that generated ``tokens`` had it stopped at
    the first stop string or end token."""
    tokens = list(tokens)
    end = next((i for i, t in enumerate(tokens) if t in lm.eos_ids), None)
    body = tokens if end is None else tokens[:end]
    for k in range(1, len(body) + 1):
        text = lm.vocab.decode(body[:k])
        ends = [text.find(s) + len(s) for s in stops if s in text]
        if ends:
            return tokens[:k], text[:min(ends)], "stop"
    if end is not None:
        return tokens[:end + 1], lm.vocab.decode(body), "eos"
    return tokens, lm.vocab.decode(tokens), "length"


def check_rule(lm, tokens, text, reason, stops):
    """The rule on a returned row: ``decode(tokens) == text`` (an end token aside), or where a
    stop string ended it, ``text`` ends with it, is a prefix of ``decode(tokens)``, and the tokens
    but the last hold none."""
    tokens = list(tokens)
    if reason == "eos":
        assert tokens[-1] in lm.eos_ids and lm.vocab.decode(tokens[:-1]) == text
    elif reason == "stop":
        full = lm.vocab.decode(tokens)
        assert full.startswith(text) and any(text.endswith(s) for s in stops), (full, text)
        assert not any(s in lm.vocab.decode(tokens[:-1]) for s in stops)
    else:
        assert lm.vocab.decode(tokens) == text
    if reason != "stop":
        assert not any(s in text for s in stops)


def substrings(text):
    """Pieces of a generated text that a stop string may be: 1-4 characters without U+FFFD."""
    return {text[i:i + m] for i in range(len(text)) for m in range(1, 5)
            if i + m <= len(text) and "\ufffd" not in text[i:i + m]}


def split_ends(lm, tokens):
    """Pieces of a run's text that end inside a token: at a character whose bytes a token holds
    part of, or before the end of a longer token's text (the harder cut)."""
    out, spans, at = set(), [], 0
    for t in tokens:
        b = lm.vocab.token_bytes(int(t))
        spans.append((at, at + len(b)))
        at += len(b)
    data = b"".join(lm.vocab.token_bytes(int(t)) for t in tokens)
    for start, stop in spans:
        for cut in range(start + 1, stop):  # a stop string's bytes end at `cut`, inside this token
            try:
                text = data[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            for m in (1, 2, 3):
                if len(text) >= m and "\ufffd" not in text[-m:]:
                    out.add(text[-m:])
    return out
