"""The decoding explorer (``/`` and ``/explore/...``) through a real ``jaxdecode serve`` on
127.0.0.1: every endpoint's numbers against the library called in this process (the rules,
:func:`jaxdecode.generate`, :func:`jaxdecode.beam_generate`, :func:`jaxdecode.mode_search`,
speculative decoding, constraints, :func:`jaxdecode.score`), and the page in headless Chromium
(Debian's ``chromium`` and ``chromium-driver``, driven by selenium): the bars against the JSON and
the scores, top-p's cuts against :func:`jaxdecode.rules.top_p`, a seeded path against
``generate``, the beam tree's survivors against ``beam_generate``, and no request to another host.
Screenshots of the six views go to ``$JAXDECODE_TEST_ARTIFACTS/explorer`` (default: a temporary
folder)."""

from __future__ import annotations

import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import jaxdecode
from jaxdecode import constraints as C
from jaxdecode.decoding.score import token_logprobs

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "ROMEO:\nWhat"
STARTUP_S = 150
REQUEST_S = 180  # an endpoint's first call compiles its programs
ATOL = 1e-4  # the server's window forward against score's: float32 rounding only
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
INSTALL = "apt-get install -y chromium chromium-driver (and pip install selenium)"


class Server:
    """``jaxdecode serve --port 0`` on the shipped model; stopped with SIGTERM, it must exit 0."""

    def __init__(self, *args):
        env = dict(os.environ)
        cache = os.environ.get("JAXDECODE_TEST_JAX_CACHE")
        if cache:
            env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.05",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxdecode.cli", "serve", "--port", "0", *args], cwd=ROOT,
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, errors="replace")
        self.out, self.err, self._lines = [], [], queue.Queue()
        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._read, args=(stream, into), daemon=True).start()
        self.root = None
        deadline = time.monotonic() + STARTUP_S
        while self.root is None and time.monotonic() < deadline and self.proc.poll() is None:
            try:
                line = self._lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if m := re.match(r"jaxdecode: serving '.+' at (http://127\.0\.0\.1:\d+)/v1$", line.strip()):
                self.root = m.group(1)
        if self.root is None:
            self.proc.kill()
            pytest.fail("the server did not start:\n" + "".join(self.out[-20:] + self.err[-20:]))
        self.client = httpx.Client(base_url=self.root, timeout=REQUEST_S)

    def _read(self, stream, into):
        for line in stream:
            into.append(line)
            self._lines.put(line)

    def post(self, path, body, status=200):
        r = self.client.post(path, json=body)
        assert r.status_code == status, r.text
        return r.json()

    def stop(self):
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(60)
        time.sleep(0.2)
        assert code == 0, "".join(self.err[-30:])
        assert "Traceback" not in "".join(self.err), "".join(self.err)


@pytest.fixture(scope="module")
def server():
    s = Server("--slots", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def lm():
    return jaxdecode.load(None)


def full_logprobs(lm, prompt: str, path=()) -> np.ndarray:
    """Every next token's log-probability after ``prompt`` and ``path``, from the library's scoring
    of each one-token continuation (not the explorer's window forward)."""
    tokens = list(lm.vocab.encode(prompt)) + list(path)
    V = lm.decoder.V
    seqs = [np.asarray(tokens + [v], np.int32) for v in range(V)]
    return np.array([lp[0] for lp in token_logprobs(lm.decoder, lm.params, seqs, [len(tokens)] * V)])


# ----------------------------------------------------------------------------- the JSON endpoints


def test_next_token_raw_and_after_each_rule(server, lm):
    # (rules that do not change under a shift of the logits: the reference applies them to log-probabilities)
    settings = {"presence_penalty": 0.8, "temperature": 0.7, "top_p": 0.8}
    path = [int(t) for t in lm.vocab.encode(" is")]
    got = server.post("/explore/next", {"prompt": PROMPT, "path": path, "settings": settings, "top": 65})
    raw = full_logprobs(lm, PROMPT, path)
    assert len(got["tokens"]) == lm.decoder.V
    for e in got["tokens"]:
        assert e["logprob"] == pytest.approx(raw[e["token"]], abs=ATOL)
    # the chain as a loop runs it: state from the prompt, updated with each token of the path
    prompt = np.asarray([lm.vocab.encode(PROMPT)], np.int32)
    rule = jaxdecode.make_rule(**settings)
    state = rule.init(prompt, np.asarray([prompt.shape[1]]), lm.decoder.V, 256)
    for t in path:
        state = rule.update(state, np.asarray([t], np.int32))
    expect = np.asarray(jaxdecode.rules.processed_logprobs(rule.apply(raw[None], state)))[0]
    kept = {e["token"] for e in got["tokens"] if e["processed_logprob"] is not None}
    assert kept == set(np.flatnonzero(np.isfinite(expect)).tolist()) and got["kept"] == len(kept)
    for e in got["tokens"]:
        if e["token"] in kept:
            assert e["processed_logprob"] == pytest.approx(expect[e["token"]], abs=ATOL)
            assert e["cut_by"] is None
        else:
            assert e["cut_by"] == "top_p"  # neither penalty nor temperature cuts a token
    assert [s["rule"] for s in got["stages"]] == ["presence_penalty", "temperature", "top_p"]


def test_next_token_names_the_rule_that_cut(server, lm):
    got = server.post("/explore/next", {"prompt": PROMPT, "settings": {"top_k": 20, "min_p": 0.05}, "top": 65})
    raw = full_logprobs(lm, PROMPT)
    order = np.argsort(-raw, kind="stable")
    by_k = set(order[20:].tolist())
    top20 = raw[order[:20]]
    by_min_p = {int(t) for t in order[:20] if np.exp(raw[t]) < 0.05 * np.exp(top20[0]) - 1e-6}
    cut = {e["token"]: e["cut_by"] for e in got["tokens"]}
    assert {t for t, r in cut.items() if r == "top_k"} == by_k
    assert {t for t, r in cut.items() if r == "min_p"} == by_min_p
    assert sum(r is None for r in cut.values()) == got["kept"] == 20 - len(by_min_p)


def test_sample_is_generate(server, lm):
    settings = {"temperature": 0.9, "top_k": 12}
    got = server.post("/explore/sample", {"prompt": PROMPT, "settings": settings, "seed": 7, "n": 10})
    g = jaxdecode.generate(lm, PROMPT, 10, seed=7, rule=jaxdecode.make_rule(**settings))[0]
    assert got["text"] == g.text and [s["token"] for s in got["steps"]] == g.tokens.tolist()
    np.testing.assert_allclose([s["logprob"] for s in got["steps"]], g.model_logprobs, atol=ATOL)
    np.testing.assert_allclose([s["processed_logprob"] for s in got["steps"]], g.sample_logprobs, atol=ATOL)
    assert got["steps"][-1]["cumulative_logprob"] == pytest.approx(float(np.sum(g.model_logprobs)), abs=1e-3)
    # a path's own draws continue from it as a prompt
    after = server.post("/explore/sample", {"prompt": PROMPT, "path": g.tokens[:4].tolist(), "settings": settings,
                                            "seed": 7, "n": 3})
    again = jaxdecode.generate(lm, PROMPT + lm.vocab.decode(g.tokens[:4].tolist()), 3, seed=7,
                               rule=jaxdecode.make_rule(**settings))[0]
    assert after["text"] == again.text


@pytest.mark.slow
def test_compare_rows_are_the_librarys(server, lm):
    got = server.post("/explore/compare", {"prompt": PROMPT, "n": 6, "k": 3, "seeds": [1, 2],
                                           "settings": {"top_p": 0.9}})
    rows = {r["method"]: r for r in got["rows"]}
    greedy = jaxdecode.generate(lm, PROMPT, 6, greedy=True)[0]
    beam = jaxdecode.beam_generate(lm, PROMPT, 6, 3)[0][0]
    samples = jaxdecode.generate(lm, [PROMPT] * 2, 6, seed=[1, 2], rule=jaxdecode.make_rule(top_p=0.9))
    tokens, lp, _ = jaxdecode.mode_search(lm.decoder, lm.params, np.asarray(lm.vocab.encode(PROMPT)), 6, 20_000)
    assert rows["greedy"]["text"] == greedy.text
    assert rows["beam k=3"]["text"] == beam.text and rows["beam k=3"]["logprob"] == pytest.approx(beam.logprob, abs=ATOL)
    for s, g in zip((1, 2), samples):
        assert rows[f"sample seed={s}"]["text"] == g.text
    assert rows["exact mode"]["tokens"] == [int(t) for t in tokens]
    assert rows["exact mode"]["logprob"] == pytest.approx(lp, abs=ATOL)
    # the mode is at least as probable as anything else found
    assert all(r["logprob"] <= rows["exact mode"]["logprob"] + ATOL for r in got["rows"] if "logprob" in r)


def test_beam_tree(server, lm):
    n, k = 5, 3
    got = server.post("/explore/beam", {"prompt": PROMPT, "n": n, "k": k, "pruned": 2})
    final = jaxdecode.beam_generate(lm, PROMPT, n, k, n_best=k)[0]
    assert [f["text"] for f in got["final"]] == [b.text for b in final]
    np.testing.assert_allclose([f["score"] for f in got["final"]], [b.score for b in final], atol=ATOL)
    ids = {"root": []}
    for level in got["levels"]:
        worst = min(s["score"] for s in level["survivors"])
        for s in level["survivors"]:
            assert s["tokens"][:-1] == ids[s["parent"]]  # each survivor extends a survivor of the step before
        for p in level["pruned"]:
            assert p["tokens"][:-1] == ids[p["parent"]] and not p["survived"]
            assert p["score"] <= worst + ATOL  # no pruned branch beats a survivor
        ids.update({s["id"]: s["tokens"] for s in level["survivors"]})
    assert len(got["levels"]) == n and all(len(lv["survivors"]) == k for lv in got["levels"])


def test_constrained_masks(server, lm):
    got = server.post("/explore/constrained", {"prompt": PROMPT, "choices": ["yes", "no"], "n": 6, "seed": 3,
                                               "top": 65})
    con = C.compile_choices(["yes", "no"], lm.vocab)
    g = jaxdecode.generate(lm, PROMPT, 6, seed=3, constraint=con)[0]
    assert got["text"] == g.text and got["text"] in ("yes", "no") and got["accepted"]
    first = got["steps"][0]
    allowed = {c["text"] for c in first["candidates"] if not c["masked"]}
    assert allowed == {"y", "n"} and first["allowed"] == 2
    assert all(s["allowed"] == 1 for s in got["steps"][1:])  # one way on from each letter


def test_speculative_passes(server, lm):
    prompt = "ROMEO: ROMEO: ROMEO:"
    got = server.post("/explore/speculative", {"prompt": prompt, "n": 16, "gamma": 3, "greedy": True})
    greedy = jaxdecode.generate(lm, prompt, 16, greedy=True)[0]
    assert got["text"] == greedy.text  # speculative greedy is greedy
    rebuilt = []
    for p in got["passes"]:
        a = p["accepted"]
        assert [q["accepted"] for q in p["proposals"]] == [True] * a + [False] * (3 - a)
        rebuilt += [q["token"] for q in p["proposals"][:a]] + [p["token"]]
    assert rebuilt[:16] == got["tokens"]
    st = got["stats"]
    assert st["passes"] == len(got["passes"]) and st["accepted"] == sum(p["accepted"] for p in got["passes"])
    assert st["examined"] == sum(p["examined"] for p in got["passes"])


@pytest.mark.quick
def test_bad_input_is_one_clear_error(server):
    cases = [
        ("/explore/next", {"prompt": "", "settings": {}}, "prompt: give a non-empty string"),
        ("/explore/next", {"prompt": "a", "settings": {"top_p": 1.5}}, "top_p: p must lie in (0, 1], got 1.5"),
        ("/explore/next", {"prompt": "a", "settings": {"top_q": 1}}, "unknown decoding setting(s): top_q"),
        ("/explore/next", {"prompt": "a", "path": [99]}, "path: token ids must be integers in [0, 65), got 99"),
        ("/explore/beam", {"prompt": "a", "n": 99}, "n must lie in [1, 16], got 99"),
        ("/explore/constrained", {"prompt": "a"}, "give one of regex (a string) or choices (a list of strings)"),
        ("/explore/speculative", {"prompt": "a", "draft": "ngram"}, "draft must be 'lookup' or 'draft'"),
    ]
    for path, body, message in cases:
        got = server.post(path, body, status=400)
        assert message in got["error"]["message"], got
    assert server.client.get("/static/..%2Fexplore.py").status_code == 404
    r = server.client.post("/explore/next", content=b"{", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_api_key_guards_the_explorer():
    """With --api-key the /explore/ routes want the key as /v1/ does (the page itself stays open,
    and asks for it); with --engine-thread the explorer computes on the engine's own model."""
    key = "explorer-key-0123"
    s = Server("--slots", "1", "--api-key", key, "--engine-thread")
    try:
        assert s.client.get("/").status_code == 200
        for r in (s.client.get("/explore/info"), s.client.post("/explore/next", json={"prompt": "a"}),
                  s.client.get("/explore/info", headers={"Authorization": "Bearer wrong"})):
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        auth = {"Authorization": f"Bearer {key}"}
        assert s.client.get("/explore/info", headers=auth).json()["vocab_size"] == 65
        got = s.client.post("/explore/next", json={"prompt": PROMPT, "top": 3}, headers=auth)
        assert got.status_code == 200 and len(got.json()["tokens"]) == 3
    finally:
        s.stop()


@pytest.mark.quick
def test_explore_command_takes_serves_options():
    """``jaxdecode explore`` parses every option of ``serve`` and leaves the port to a free one."""
    from jaxdecode.cli.app import build_parser
    from jaxdecode.cli.explore import cmd_explore

    args = build_parser().parse_args(["explore", "--slots", "3", "--engine-thread"])
    assert args.func is cmd_explore and args.port is None and args.slots == 3 and args.engine_thread
    assert build_parser().parse_args(["explore", "--port", "8123"]).port == 8123
    serve = build_parser().parse_args(["serve"])
    assert {k for k in vars(serve) if k not in ("func", "command")} == {
        k for k in vars(args) if k not in ("func", "command")}


# ----------------------------------------------------------------------------- the page in a browser


def _browser():
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip(f"no headless Chromium here: {INSTALL}")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip(f"selenium is not installed: {INSTALL}")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,1100"):
        options.add_argument(flag)
    options.add_argument("--user-data-dir=" + tempfile.mkdtemp(prefix="jaxdecode-chromium-"))
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture(scope="module")
def page(server):
    driver = _browser()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    folder = os.environ.get("JAXDECODE_TEST_ARTIFACTS")
    folder = Path(folder) / "explorer" if folder else tmp_path_factory.mktemp("explorer")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _wait(driver, check, what, timeout=REQUEST_S):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(lambda d: check(d), message=f"the page never showed {what}")


def _by(driver, css):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def _text(element) -> str:
    return element.get_attribute("textContent")


def _next_settled(driver, after: int) -> int:
    """Wait for a next-token update after update number ``after``; its number."""
    seq = _wait(driver, lambda d: int(d.find_element("tag name", "body").get_attribute("data-next-seq") or 0) > after
                and int(d.find_element("tag name", "body").get_attribute("data-next-seq")), "the bars updated")
    return int(seq)


def _set(driver, element_id, value):
    element = driver.find_element("id", element_id)
    driver.execute_script("arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input'))",
                          element, value)


@pytest.mark.slow
def test_page_bars_top_p_and_no_other_host(server, page, lm, shots):
    page.get(server.root + "/")
    _wait(page, lambda d: d.find_element("tag name", "body").get_attribute("data-ready") == "1", "its first bars")
    _set(page, "prompt", PROMPT)
    seq = _next_settled(page, int(page.find_element("tag name", "body").get_attribute("data-next-seq")))
    want = server.post("/explore/next", {"prompt": PROMPT, "settings": {}, "top": 30})
    bars = _by(page, "#bars li.bar")
    assert [int(b.get_attribute("data-token")) for b in bars] == [t["token"] for t in want["tokens"]]
    raw = full_logprobs(lm, PROMPT)
    for b, t in zip(bars, want["tokens"]):
        shown = _text(b.find_element("css selector", ".prob"))
        assert shown == f"{t['prob']:.4f}" == f"{math.exp(raw[t['token']]):.4f}"
    _set(page, "rule-top_p", "0.6")
    _next_settled(page, seq)
    cut = {int(b.get_attribute("data-token")) for b in _by(page, "#bars li.bar.cut")}
    assert all(b.get_attribute("data-cut-by") == "top_p" for b in _by(page, "#bars li.bar.cut"))
    top_p = np.asarray(jaxdecode.rules.top_p(0.6).apply(raw[None], ()))[0]
    expect = {int(t) for t in np.flatnonzero(~np.isfinite(top_p))} & {t["token"] for t in want["tokens"]}
    assert cut == expect and cut
    print(f"explorer: next-token view updated in {page.find_element('tag name', 'body').get_attribute('data-next-ms')} "
          f"ms (fetch and draw, measured in the browser)")
    page.save_screenshot(str(shots / "next-token.png"))
    origin = server.root
    urls = page.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert urls and all(u.startswith(origin + "/") for u in urls), urls
    # the keyboard: Enter on a focused bar appends its token
    bar = _by(page, "#bars li.bar")[1]
    token = int(bar.get_attribute("data-token"))
    bar.send_keys("\n")
    _wait(page, lambda d: len(_by(d, "#path tbody tr")) == 1, "the token appended")
    assert _text(page.find_element("id", "path-text")) == lm.vocab.decode([token])
    # a phone's width: nothing wider than the screen but the beam tree's own scrolling box
    page.set_window_size(390, 844)
    assert page.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    page.save_screenshot(str(shots / "phone.png"))
    page.set_window_size(1280, 1100)


@pytest.mark.slow
def test_page_seeded_path_beam_tree_and_views(server, page, lm, shots):
    page.get(server.root + "/")
    _wait(page, lambda d: d.find_element("tag name", "body").get_attribute("data-ready") == "1", "its first bars")
    _set(page, "prompt", PROMPT)
    _next_settled(page, int(page.find_element("tag name", "body").get_attribute("data-next-seq")))
    page.save_screenshot(str(shots / "next-token.png"))
    _set(page, "rule-top_k", "12")
    _set(page, "seed", "5")
    _set(page, "draw-n", "8")
    page.find_element("id", "draw").click()
    g = jaxdecode.generate(lm, PROMPT, 8, seed=5, rule=jaxdecode.make_rule(top_k=12))[0]
    _wait(page, lambda d: len(_by(d, "#path tbody tr")) == 8, "a path of 8 tokens")
    assert _text(page.find_element("id", "path-text")) == g.text
    cells = [[_text(td) for td in tr.find_elements("tag name", "td")] for tr in _by(page, "#path tbody tr")]
    assert [c[2] for c in cells] == [f"{math.exp(x):.4f}" for x in g.model_logprobs]
    assert [c[3] for c in cells] == [f"{math.exp(x):.4f}" for x in g.sample_logprobs]
    running = np.cumsum(np.asarray(g.model_logprobs, np.float64))
    assert all(abs(float(c[4]) - r) <= 2e-4 for c, r in zip(cells, running))  # printed to 4 places
    page.save_screenshot(str(shots / "step.png"))

    _set(page, "rule-top_k", "")
    page.find_element("id", "tab-beam").click()
    _set(page, "beam-n", "5")
    page.find_element("id", "beam-run").click()
    _wait(page, lambda d: len(_by(d, "#beam-final li")) == 3, "the beam tree")
    final = jaxdecode.beam_generate(lm, PROMPT, 5, 3, n_best=3)[0]
    assert [li.get_attribute("data-text") for li in _by(page, "#beam-final li")] == [b.text for b in final]
    assert len(_by(page, "#tree g.pruned")) > 0 and len(_by(page, "#tree g.final")) == 3
    page.save_screenshot(str(shots / "beam-tree.png"))

    views = (("compare", "cmp-run", "#compare tbody tr", 5), ("speculative", "spec-run", "#spec-passes li", 1),
             ("constrained", "con-run", "#con-steps li", 2))
    for view, button, rows, least in views:
        page.find_element("id", f"tab-{view}").click()
        if view == "compare":
            _set(page, "cmp-n", "6")
            _set(page, "cmp-k", "3")
        page.find_element("id", button).click()
        _wait(page, lambda d, rows=rows, least=least: len(_by(d, rows)) >= least, f"the {view} view")
        page.save_screenshot(str(shots / f"{view}.png"))
    assert len(list(shots.glob("*.png"))) >= 6
