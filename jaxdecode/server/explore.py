"""The decoding explorer: the page at ``/`` and its JSON endpoints under ``/explore/`` (``docs/explorer.md``).

Every number comes from the library's own code: the next-token view applies each rule of
:data:`jaxdecode.rules.REGISTRY` (the factory, ``init``, ``update`` and ``apply`` a loop calls)
to the model's window prediction (:func:`~jaxdecode.decoding.common.next_logits_for`); a drawn
path is :func:`jaxdecode.generate`'s; the comparison runs :func:`~jaxdecode.decoding.sampling.generate`,
:func:`~jaxdecode.decoding.beam.beam_generate` and :func:`~jaxdecode.decoding.search.mode_search`;
the beam tree is :func:`~jaxdecode.decoding.beam.beam_search` run for 1, 2, ... steps (the live
beams after ``t`` steps are a search of ``t`` steps' hypotheses), its pruned branches each
survivor's best children under the same rule; the constrained view walks the compiled automaton
with :func:`jaxdecode.constraints.allowed`. A speculative run comes from a function the command
line hands in (``speculate``), since this layer does not import the drafts.

The explorer holds a model of its own, loaded on the first request (``load``); with the engine
in a process of its own, that is a second copy of the parameters in the server's process. Its
computations run one at a time in a worker thread, so the event loop keeps serving the engine's
requests meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import math
import threading
from importlib import resources

import numpy as np
from fastapi import Request as HTTPRequest
from fastapi.responses import FileResponse, RedirectResponse
from pydantic import BaseModel, ConfigDict, Field, create_model

from jaxdecode import constraints as C
from jaxdecode.decoding.beam import BeamSearchError, beam_generate, beam_search
from jaxdecode.decoding.common import next_logits_for, round_up, sample_keys
from jaxdecode.decoding.sampling import generate, sample_tokens
from jaxdecode.decoding.search import SearchBudgetExceeded, mode_search
from jaxdecode.decoding.stops import stop_automaton
from jaxdecode.rules import REGISTRY, RuleError, make_rule, processed_logprobs
from jaxdecode.server.handlers import token_text
from jaxdecode.server.protocol import APIError, documented

LIMITS = {"top": 200, "n": 64, "k": 8, "seeds": 8, "tree_steps": 16, "exact_n": 16, "exact_budget": 20_000,
          "gamma": 8}
STATIC = "static"  # the page's files, in this package
FLOAT32_MAX = float(np.finfo(np.float32).max)


class Explorer:
    """The model the endpoints compute with, loaded once by ``load()`` (a callable returning a
    :class:`~jaxdecode.models.lm.LanguageModel`); ``speculate(lm, prompt, n, *, draft, gamma,
    seed, greedy, rule)``: a speculative run as a dict, or None where none is offered."""

    def __init__(self, load, speculate=None):
        self._load, self.speculate = load, speculate
        self._lm = None
        self._lock = threading.Lock()

    @property
    def lm(self):
        if self._lm is None:
            self._lm = self._load()
        return self._lm

    async def run(self, fn, *args, **kw):
        """``fn(lm, *args, **kw)`` in a worker thread, one computation at a time; a bad setting is
        a 400 naming it."""
        def call():
            with self._lock:
                return fn(self.lm, *args, **kw)

        try:
            return _finite(await asyncio.to_thread(call))
        except (RuleError, C.ConstraintError, BeamSearchError, ValueError) as e:
            raise APIError(400, str(e)) from None


def _finite(value):
    """A result with every float that JSON cannot hold (infinities, NaN: a log-probability after a
    setting that pushes the logits past float32's range) as None, :func:`_num`'s convention."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# ----------------------------------------------------------------------------- request fields


def _field(body: dict, name: str, kind, default=None, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        return None
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise APIError(400, f"{name} must be {_KIND_NAMES.get(kind, kind.__name__)}, got {value!r}", param=name)
    if low is not None and value < low or high is not None and value > high:
        raise APIError(400, f"{name} must lie in [{low}, {high}], got {value!r}", param=name)
    return value


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               list: "a list", dict: "an object"}


def _prompt(body: dict) -> str:
    prompt = _field(body, "prompt", str)
    if not prompt:
        raise APIError(400, "prompt: give a non-empty string", param="prompt")
    return prompt


def _settings(body: dict) -> dict:
    """The rule settings ``{name: value}`` (None and absent: unset), checked by the rules' own
    factories."""
    settings = _field(body, "settings", dict, {}) or {}
    settings = {k: v for k, v in settings.items() if v is not None}
    for name, value in settings.items():  # (the rules take arrays too, a value per row: here, one number)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise APIError(400, f"settings.{name} must be a number, got {value!r}"[:200], param="settings")
        if not abs(value) <= FLOAT32_MAX:  # (the logits are float32: past it, a setting makes them NaN)
            raise APIError(400, f"settings.{name} must be a finite float32 number, got {value!r}", param="settings")
    try:
        make_rule(**settings)  # an unknown name or a value out of range
    except RuleError as e:
        raise APIError(400, str(e), param="settings") from None
    return settings


def _path(body: dict, V: int) -> list[int]:
    path = _field(body, "path", list, []) or []
    for t in path:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
            raise APIError(400, f"path: token ids must be integers in [0, {V}), got {t!r}", param="path")
    return path


def _encode(lm, prompt: str) -> list[int]:
    try:
        tokens = [int(t) for t in lm.vocab.encode(prompt)]
    except ValueError as e:
        raise ValueError(f"the prompt cannot be encoded: {e}") from None
    if not tokens:
        raise ValueError("the prompt encodes to no tokens")
    return tokens


def _text(lm, token: int) -> str:
    return token_text(lm.vocab, int(token))[0]


def _num(x) -> float | None:
    """A float for JSON: None for -inf (a cut token's log-probability) or NaN."""
    x = float(x)
    return x if math.isfinite(x) else None


# ----------------------------------------------------------------------------- computations


_PREDICTORS: dict = {}  # id(lm) -> (lm, its next_logits)


def raw_logits(lm, tokens: list[int]) -> np.ndarray:
    """The model's next-token logits ``[V]`` after ``tokens``."""
    if id(lm) not in _PREDICTORS:
        _PREDICTORS[id(lm)] = (lm, next_logits_for(lm.decoder, lm.params, batch_size=16))
    return np.asarray(_PREDICTORS[id(lm)][1](np.asarray([tokens], np.int32))[0], np.float32)


def _rule_states(rule, prompt: list[int], path: list[int], V: int):
    """A rule's state after the prompt and the tokens of ``path``, as a loop keeps it."""
    state = rule.init(np.asarray([prompt], np.int32), np.asarray([len(prompt)], np.int32), V,
                      round_up(len(path) + 1, 256))
    for t in path:
        state = rule.update(state, np.asarray([t], np.int32))
    return state


def next_token(lm, prompt: str, path: list[int], settings: dict, top: int = 30) -> dict:
    """The next token's distribution after ``prompt`` and ``path``: raw, after each rule, after
    the whole chain; the rule that cut each token."""
    tokens = _encode(lm, prompt)
    V = lm.decoder.V
    logits = raw_logits(lm, tokens + path)[None]  # [1, V]
    raw = np.asarray(processed_logprobs(logits))[0]
    cut_by = np.full((V,), -1, np.int32)
    x, stages = logits, []
    for spec in REGISTRY:
        if spec.name not in settings:
            continue
        rule = spec.factory(settings[spec.name])
        before = np.isfinite(np.asarray(x)[0])
        x = rule.apply(x, _rule_states(rule, tokens, path, V))
        after = np.isfinite(np.asarray(x)[0])
        cut_by[before & ~after] = len(stages)
        stages.append({"rule": spec.name, "value": settings[spec.name], "kept": int(after.sum())})
    chain = make_rule(**settings)
    final = logits if chain is None else chain.apply(logits, _rule_states(chain, tokens, path, V))
    processed = np.asarray(processed_logprobs(final))[0]
    order = np.argsort(-raw, kind="stable")[:top]
    extra = [t for t in np.argsort(-processed, kind="stable")[:top] if t not in set(order.tolist())
             and np.isfinite(processed[t])]
    shown = list(order) + extra
    entries = []
    for t in shown:
        entries.append({"token": int(t), "text": _text(lm, t), "logprob": _num(raw[t]), "prob": float(np.exp(raw[t])),
                        "processed_logprob": _num(processed[t]), "processed_prob": float(np.exp(processed[t])),
                        "cut_by": stages[cut_by[t]]["rule"] if cut_by[t] >= 0 else None,
                        "rank": int(np.sum(raw > raw[t]))})
    entropy = lambda lp: 0.0 + float(-np.sum(np.where(np.isfinite(lp), np.exp(lp) * np.where(np.isfinite(lp), lp, 0), 0)))
    return {"prompt_tokens": tokens, "path": path, "context": len(tokens) + len(path), "vocab_size": V,
            "stages": stages, "kept": int(np.isfinite(processed).sum()), "entropy": entropy(raw),
            "processed_entropy": entropy(processed), "tokens": entries}


def _steps(lm, tokens, model_lp, sample_lp) -> list[dict]:
    out, total = [], 0.0
    for t, m, s in zip(tokens, model_lp, sample_lp):
        total += float(m)
        out.append({"token": int(t), "text": _text(lm, t), "logprob": _num(m), "prob": float(np.exp(m)),
                    "processed_logprob": _num(s), "processed_prob": float(np.exp(s)), "cumulative_logprob": total})
    return out


def sample(lm, prompt: str, path: list[int], settings: dict, seed: int, n: int, greedy: bool = False) -> dict:
    """``n`` tokens drawn with ``seed``: with no ``path``, :func:`jaxdecode.generate`'s (no folder
    defaults: the settings given are all there is); after a path, the sampling loop continued from
    the prompt's tokens and the path's, as a prompt."""
    rule = make_rule(**settings)
    if not path:
        g = generate(lm, prompt, n, seed=seed, rule=rule, greedy=greedy, generation_config=False)[0]
        toks, mlp, slp, reason = g.tokens, g.model_logprobs, g.sample_logprobs, g.finish_reason
    else:
        keys, ids = sample_keys(1, 1, seed)
        res = sample_tokens(lm.decoder, lm.params, [np.asarray(_encode(lm, prompt) + path, np.int32)], n, keys,
                            rule=rule, greedy=greedy, row_ids=ids, stops=stop_automaton(lm, None))
        c = int(res.counts[0])
        toks, mlp, slp = res.tokens[0, :c], res.model_logprobs[0, :c], res.sample_logprobs[0, :c]
        reason = "stop" if res.stopped[0] else "length"
    return {"seed": seed, "greedy": greedy, "steps": _steps(lm, toks, mlp, slp),
            "text": lm.vocab.decode([int(t) for t in toks]), "finish_reason": reason}


def compare(lm, prompt: str, n: int, k: int, seeds: list[int], settings: dict, exact_budget: int) -> dict:
    """Greedy, beam search of width ``k``, one sample per seed and (for ``n`` up to
    LIMITS["exact_n"]) the exact mode, each with the model's log-probability of its tokens."""
    rule = make_rule(**settings)
    rows = []

    def row(method, tokens, logprob, text=None, **extra):
        tokens = [int(t) for t in tokens]
        rows.append({"method": method, "tokens": tokens, "text": lm.vocab.decode(tokens) if text is None else text,
                     "logprob": _num(logprob), "mean_logprob": _num(logprob / len(tokens)) if tokens else None,
                     **extra})

    g = generate(lm, prompt, n, greedy=True, generation_config=False)[0]
    row("greedy", g.tokens, float(np.sum(g.model_logprobs, dtype=np.float64)), g.text)
    b = beam_generate(lm, prompt, n, k)[0][0]
    row(f"beam k={k}", b.tokens, b.logprob, b.text, score=_num(b.score))
    if seeds:
        samples = generate(lm, [prompt] * len(seeds), n, seed=list(seeds), rule=rule, generation_config=False)
        for s, g in zip(seeds, samples):
            row(f"sample seed={s}", g.tokens, float(np.sum(g.model_logprobs, dtype=np.float64)), g.text, seed=s)
    if n <= LIMITS["exact_n"]:
        ends = [int(e[0]) for e in lm.end_stops if len(e) == 1]
        try:
            toks, lp, nodes = mode_search(lm.decoder, lm.params, np.asarray(_encode(lm, prompt), np.int32), n,
                                          exact_budget, end_tokens=ends)
            row("exact mode", toks, lp, nodes=int(nodes))
        except SearchBudgetExceeded:
            rows.append({"method": "exact mode", "skipped": f"more than {exact_budget} nodes to expand"})
    else:
        rows.append({"method": "exact mode", "skipped": f"searched only for n <= {LIMITS['exact_n']}"})
    return {"n": n, "k": k, "settings": settings, "rows": rows}


def beam_tree(lm, prompt: str, n: int, k: int, settings: dict, children: int) -> dict:
    """The beams of a width-``k`` search over ``n`` steps as a tree: after ``t`` steps the
    survivors are the hypotheses of :func:`~jaxdecode.decoding.beam.beam_search` run for ``t``
    steps (end tokens count as ordinary tokens here); under each survivor of step ``t - 1``,
    its ``children`` best extensions that did not survive step ``t`` are the pruned branches,
    scored as the search scores them (the parent's score plus the rule-processed log-probability)."""
    rule = make_rule(**settings)
    tokens = _encode(lm, prompt)
    prompt_arr = np.asarray(tokens, np.int32)
    V = lm.decoder.V
    levels, parents = [], [{"id": "root", "tokens": [], "score": 0.0, "logprob": 0.0}]
    for t in range(1, n + 1):
        hyps = beam_search(lm.decoder, lm.params, [prompt_arr], t, k, n_best=k, rule=rule).hypotheses[0]
        by_prefix = {tuple(p["tokens"]): p for p in parents}
        survivors = []
        for j, h in enumerate(hyps):
            seq = [int(x) for x in h.tokens]
            parent = by_prefix.get(tuple(seq[:-1]))
            survivors.append({"id": f"{t}.{j}", "parent": parent["id"] if parent else None, "tokens": seq,
                              "token": seq[-1], "text": _text(lm, seq[-1]), "score": _num(h.score),
                              "logprob": _num(h.logprob), "survived": True})
        kept = {tuple(s["tokens"]) for s in survivors}
        pruned = []
        for p in parents:
            logits = raw_logits(lm, tokens + p["tokens"])[None]
            if rule is not None:
                logits = rule.apply(logits, _rule_states(rule, tokens, p["tokens"], V))
            lp = np.asarray(processed_logprobs(logits))[0]
            model_lp = np.asarray(processed_logprobs(raw_logits(lm, tokens + p["tokens"])[None]))[0]
            shown = 0
            for c in np.argsort(-lp, kind="stable"):
                if shown >= children or not np.isfinite(lp[c]):
                    break
                if tuple(p["tokens"] + [int(c)]) in kept:
                    continue
                shown += 1
                pruned.append({"id": f"{t}.x{len(pruned)}", "parent": p["id"], "tokens": p["tokens"] + [int(c)],
                               "token": int(c), "text": _text(lm, c), "score": _num(p["score"] + lp[c]),
                               "logprob": _num(p["logprob"] + model_lp[c]), "survived": False})
        levels.append({"step": t, "survivors": survivors, "pruned": pruned})
        parents = [{"id": s["id"], "tokens": s["tokens"], "score": s["score"], "logprob": s["logprob"]}
                   for s in survivors]
    final = [{"tokens": s["tokens"], "text": lm.vocab.decode(s["tokens"]), "score": s["score"],
              "logprob": s["logprob"]} for s in (levels[-1]["survivors"] if levels else [])]
    return {"n": n, "k": k, "settings": settings, "levels": levels, "final": final}


@functools.lru_cache(maxsize=16)
def _compiled(kind: str, key, vocab):
    if kind == "regex":
        return C.compile_regex(key, vocab)
    return C.compile_choices(list(key), vocab)


def constrained(lm, prompt: str, kind: str, key, n: int, seed: int, greedy: bool, settings: dict,
                top: int) -> dict:
    """A constrained run (:func:`jaxdecode.generate` with the compiled constraint) and, at each
    step, the automaton's state, how many tokens it allows with the steps left, and the model's
    ``top`` most probable tokens with those the automaton forbids marked."""
    con = _compiled(kind, key, lm.vocab)
    con.check_budget(n)
    g = generate(lm, prompt, n, seed=seed, rule=make_rule(**settings), greedy=greedy, constraint=con,
                 generation_config=False)[0]
    auto, starts = C.stack([con], lm.decoder.V)
    table, offset = np.asarray(auto.table), int(starts[0])  # the stacked table's states: the pattern's + offset
    tokens = _encode(lm, prompt)
    state, steps, total = offset, [], 0.0
    gen = [int(t) for t in g.tokens]
    for i, t in enumerate(gen):
        ok, _ = C.allowed(auto, np.asarray([state], np.int32), np.asarray([n - i], np.int32))
        ok = np.asarray(ok)[0]
        raw = np.asarray(processed_logprobs(raw_logits(lm, tokens + gen[:i])[None]))[0]
        order = np.argsort(-raw, kind="stable")[:top]
        total += float(g.model_logprobs[i])
        steps.append({"state": state - offset, "allowed": int(ok.sum()), "token": t, "text": _text(lm, t),
                      "logprob": _num(g.model_logprobs[i]), "cumulative_logprob": total,
                      "candidates": [{"token": int(c), "text": _text(lm, c), "prob": float(np.exp(raw[c])),
                                      "masked": not bool(ok[c])} for c in order]})
        state = int(table[state, t])
    return {"kind": kind, "pattern": con.pattern, "text": g.text, "finish_reason": g.finish_reason,
            "accepted": con.accepts(gen), "steps": steps}


# ----------------------------------------------------------------------------- the published bodies
# The endpoints read their bodies by hand (_field: a 400 naming the field); these models only
# describe them in the OpenAPI document. A field left out takes its default; other fields are ignored.


# the rule settings by name (jaxdecode.rules.REGISTRY), each value checked by its rule
_Settings = create_model("Settings", __config__=ConfigDict(extra="forbid"),
                         **{spec.name: ((int if spec.type is int else float) | None, None) for spec in REGISTRY})


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")  # (documents it; _body refuses them)

    prompt: str = Field(min_length=1)
    settings: _Settings | None = None


class _Drawn(_Common):
    seed: int = Field(0, ge=0, le=2**63 - 1)
    greedy: bool = False


class NextBody(_Common):
    top: int = Field(30, ge=1, le=LIMITS["top"])
    path: list[int] | None = Field(None, description="token ids after the prompt, each in [0, vocabulary size)")


class SampleBody(_Drawn):
    n: int = Field(1, ge=1, le=LIMITS["n"])
    path: list[int] | None = Field(None, description="token ids after the prompt, each in [0, vocabulary size)")


class CompareBody(_Common):
    n: int = Field(12, ge=1, le=LIMITS["n"])
    k: int = Field(4, ge=1, le=LIMITS["k"])
    seeds: list[int] = Field([0, 1, 2], max_length=LIMITS["seeds"])
    exact_budget: int = Field(LIMITS["exact_budget"], ge=1, le=LIMITS["exact_budget"])


class BeamBody(_Common):
    n: int = Field(6, ge=1, le=LIMITS["tree_steps"])
    k: int = Field(3, ge=1, le=LIMITS["k"])
    pruned: int = Field(2, ge=0, le=LIMITS["k"])


class ConstrainedBody(_Drawn):
    regex: str | None = Field(None, description="give one of regex and choices")
    choices: list[str] | None = Field(None, min_length=1)
    n: int = Field(16, ge=1, le=LIMITS["n"])
    top: int = Field(12, ge=1, le=LIMITS["top"])


class SpeculativeBody(_Drawn):
    n: int = Field(32, ge=1, le=LIMITS["n"])
    gamma: int = Field(3, ge=1, le=LIMITS["gamma"])
    draft: str = "lookup"


def _documented(body: type[BaseModel] | None, *errors: int) -> dict:
    """A route's ``responses`` and its ``openapi_extra`` (the request body it reads by hand)."""
    kw = {"responses": documented(None, 401, *errors)}
    if body is not None:
        schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
        defs = schema.pop("$defs", {})
        if defs:  # (the nested models inline: the document's components hold only the routes' own)
            schema = _inline(schema, defs)
        kw["openapi_extra"] = {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
        kw["responses"] = documented(None, 400, 401, 413, *errors)
    return kw


def _inline(schema, defs: dict):
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            return _inline(defs[ref.rsplit("/", 1)[1]], defs)
        return {k: _inline(v, defs) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_inline(v, defs) for v in schema]
    return schema


# ----------------------------------------------------------------------------- routes


async def _body(request: HTTPRequest, model: type[BaseModel]) -> dict:
    """The request's JSON object, its fields those of ``model`` (a misspelt one is refused by name,
    as on ``/v1/``, not ignored)."""
    try:
        body = await request.json()
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - set(model.model_fields))
    if unknown:
        raise APIError(400, f"unknown field(s): {', '.join(map(str, unknown))}; this endpoint takes "
                            f"{', '.join(model.model_fields)}", param=str(unknown[0]))
    return body


def add_explorer(app, explorer: Explorer | None, api_key: str | None = None) -> None:
    """Register the page (``/``, ``/static/...``) and the endpoints (``/explore/...``) on ``app``;
    with no explorer, the endpoints answer 503. With ``api_key``, the endpoints require it as the
    ``/v1/`` routes do (``Authorization: Bearer KEY``); the page asks for it."""
    static = resources.files("jaxdecode.server") / STATIC

    def need(request: HTTPRequest) -> Explorer:
        if api_key and not hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                               f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if explorer is None:
            raise APIError(503, "this server has no explorer model (start it with jaxdecode serve or "
                                "jaxdecode explore)")
        return explorer

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(str(static / "index.html"), media_type="text/html")

    @app.get("/explore", include_in_schema=False)
    async def page_alias():
        return RedirectResponse("/")

    @app.get("/static/{name}", include_in_schema=False)
    async def asset(name: str):
        if "/" in name or name.startswith(".") or not (static / name).is_file():
            raise APIError(404, f"no file {name}")
        kind = {"js": "text/javascript", "css": "text/css", "html": "text/html", "svg": "image/svg+xml"}
        return FileResponse(str(static / name), media_type=kind.get(name.rsplit(".", 1)[-1], "text/plain"))

    @app.get("/explore/info", **_documented(None))
    async def info(request: HTTPRequest):
        ex = need(request)

        def describe(lm):
            return {"vocab_size": lm.decoder.V, "window": lm.decoder.T,
                    "subword": bool(getattr(lm.vocab, "subword", False)),
                    "defaults": dict(getattr(lm, "generation_defaults", None) or {}),
                    "speculative": ex.speculate is not None, "limits": LIMITS,
                    "rules": [{"name": s.name, "kind": s.kind, "integer": s.type is int, "help": s.help,
                               "neutral": s.neutral} for s in REGISTRY]}

        return await ex.run(describe)

    @app.post("/explore/next", **_documented(NextBody))
    async def next_view(request: HTTPRequest):
        ex, body = need(request), await _body(request, NextBody)
        top = _field(body, "top", int, 30, 1, LIMITS["top"])
        prompt, settings = _prompt(body), _settings(body)
        return await ex.run(lambda lm: next_token(lm, prompt, _path(body, lm.decoder.V), settings, top))

    @app.post("/explore/sample", **_documented(SampleBody))
    async def sample_view(request: HTTPRequest):
        ex, body = need(request), await _body(request, SampleBody)
        prompt, settings = _prompt(body), _settings(body)
        seed = _field(body, "seed", int, 0, 0, 2**63 - 1)
        n = _field(body, "n", int, 1, 1, LIMITS["n"])
        greedy = _field(body, "greedy", bool, False)
        return await ex.run(lambda lm: sample(lm, prompt, _path(body, lm.decoder.V), settings, seed, n, greedy))

    @app.post("/explore/compare", **_documented(CompareBody))
    async def compare_view(request: HTTPRequest):
        ex, body = need(request), await _body(request, CompareBody)
        prompt, settings = _prompt(body), _settings(body)
        n = _field(body, "n", int, 12, 1, LIMITS["n"])
        k = _field(body, "k", int, 4, 1, LIMITS["k"])
        seeds = _field(body, "seeds", list, [0, 1, 2]) or []
        if len(seeds) > LIMITS["seeds"] or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                   for s in seeds):
            raise APIError(400, f"seeds: give up to {LIMITS['seeds']} non-negative integers", param="seeds")
        budget = _field(body, "exact_budget", int, LIMITS["exact_budget"], 1, LIMITS["exact_budget"])
        return await ex.run(compare, prompt, n, k, seeds, settings, budget)

    @app.post("/explore/beam", **_documented(BeamBody))
    async def beam_view(request: HTTPRequest):
        ex, body = need(request), await _body(request, BeamBody)
        prompt, settings = _prompt(body), _settings(body)
        n = _field(body, "n", int, 6, 1, LIMITS["tree_steps"])
        k = _field(body, "k", int, 3, 1, LIMITS["k"])
        children = _field(body, "pruned", int, 2, 0, LIMITS["k"])
        return await ex.run(beam_tree, prompt, n, k, settings, children)

    @app.post("/explore/constrained", **_documented(ConstrainedBody))
    async def constrained_view(request: HTTPRequest):
        ex, body = need(request), await _body(request, ConstrainedBody)
        prompt, settings = _prompt(body), _settings(body)
        regex, choices = _field(body, "regex", str), _field(body, "choices", list)
        if (regex is None) == (choices is None):
            raise APIError(400, "give one of regex (a string) or choices (a list of strings)")
        if choices is not None and (not choices or not all(isinstance(c, str) and c for c in choices)):
            raise APIError(400, "choices: give a list of non-empty strings", param="choices")
        kind, key = ("regex", regex) if regex is not None else ("choice", tuple(choices))
        n = _field(body, "n", int, 16, 1, LIMITS["n"])
        seed = _field(body, "seed", int, 0, 0, 2**63 - 1)
        greedy = _field(body, "greedy", bool, False)
        top = _field(body, "top", int, 12, 1, LIMITS["top"])
        return await ex.run(constrained, prompt, kind, key, n, seed, greedy, settings, top)

    @app.post("/explore/speculative", **_documented(SpeculativeBody, 501))
    async def speculative_view(request: HTTPRequest):
        ex, body = need(request), await _body(request, SpeculativeBody)
        if ex.speculate is None:
            raise APIError(501, "this server offers no speculative runs")
        prompt, settings = _prompt(body), _settings(body)
        n = _field(body, "n", int, 32, 1, LIMITS["n"])
        gamma = _field(body, "gamma", int, 3, 1, LIMITS["gamma"])
        seed = _field(body, "seed", int, 0, 0, 2**63 - 1)
        greedy = _field(body, "greedy", bool, False)
        draft = _field(body, "draft", str, "lookup")
        return await ex.run(lambda lm: ex.speculate(lm, prompt, n, draft=draft, gamma=gamma, seed=seed,
                                                    greedy=greedy, rule=make_rule(**settings)))
