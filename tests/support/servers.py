"""The server tests' harness: ``jaxdecode serve --port 0`` subprocesses on 127.0.0.1
(:class:`ServerProcess`), the expected answers from :func:`jaxdecode.generate`, raw HTTP helpers and
OpenAI's error JSON, and :func:`serving`: processes for one test module, started together and
stopped together with SIGTERM at the end, each required to exit 0 without a traceback on its stderr
(so an unexpected error that a server logged fails the module even where its answer looked fine)."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import jaxdecode  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "tests" / "fixtures" / "hf" / "llama"
KEY = "test-key-0123"
STARTUP_S = 150  # a server's start: importing jax and loading the model, on a busy machine
STOP_S = 60  # SIGTERM to exit (requests in flight end first)
REQUEST_S = 90  # one request's answer (its first one compiles the engine's programs)
SETTLE_S = 20  # a disconnected client's request leaves the engine
LOGPROB_ATOL = 1e-4  # the engine's batches vs score's: float32 rounding only

# the character model's chat template (it has none of its own): plain "role: content" turns
CHAR_TEMPLATE = ("{%- for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{ 'assistant:' }}{%- endif %}")
# for the llama fixture, only if its folder has no template of its own
CHATML_TEMPLATE = ("{{- bos_token }}{%- for m in messages %}"
                   "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + eos_token + '\\n' }}{%- endfor %}"
                   "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Speak, ROMEO."}]
CHAR_CHAT_PROMPT = "system: Be brief.\nuser: Speak, ROMEO.\nassistant:"  # CHAT rendered by CHAR_TEMPLATE

# every metric of jaxdecode/server/metrics.py, as Prometheus' text format names its samples
METRIC_SAMPLES = ["jaxdecode_" + name for name in (
    "requests_running", "requests_waiting", "kv_blocks_used", "kv_blocks_free", "prompt_tokens_total",
    "generation_tokens_total", "time_to_first_token_seconds_bucket", "time_to_first_token_seconds_count",
    "time_to_first_token_seconds_sum", "time_per_output_token_seconds_bucket",
    "time_per_output_token_seconds_count", "time_per_output_token_seconds_sum", "prefix_cache_queries_total",
    "prefix_cache_hits_total", "prefix_cache_evictions_total")]
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable"}


# ----------------------------------------------------------------------------- server processes


class ServerProcess:
    """One ``jaxdecode serve --port 0`` subprocess; its stdout and stderr are read by threads, so
    every wait on them is bounded."""

    def __init__(self, *args: str):
        env = dict(os.environ)
        env.pop("JAXDECODE_API_KEY", None)
        cache = os.environ.get("JAXDECODE_TEST_JAX_CACHE")
        if cache:  # the servers share compiled programs (the same model's programs are compiled once)
            env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.05",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        self.args = args
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxdecode.cli", "serve", "--port", "0", *args],
                                     cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, errors="replace")
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        for stream, into in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr)):
            threading.Thread(target=self._read, args=(stream, into), daemon=True).start()
        self.url: str | None = None
        self.name: str | None = None

    def _read(self, stream, into):
        for line in stream:
            into.append(line)
            self._lines.put(line)

    def ready(self) -> ServerProcess:
        """Wait for the address line (``jaxdecode: serving '<name>' at http://host:port/v1``)."""
        deadline = time.monotonic() + STARTUP_S
        while self.url is None:
            if self.proc.poll() is not None and self._lines.empty():
                time.sleep(0.2)  # the readers' last lines
                pytest.fail(f"the server {self.args} exited with {self.proc.returncode} before it served:\n"
                            + self.tail())
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                pytest.fail(f"the server {self.args} printed no address in {STARTUP_S} s:\n" + self.tail())
            try:
                line = self._lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            m = re.match(r"jaxdecode: serving '(.+)' at (http://127\.0\.0\.1:\d+/v1)$", line.strip())
            if m:
                self.name, self.url = m.group(1), m.group(2)
        return self

    @property
    def root(self) -> str:
        return self.url[:-len("/v1")]

    def tail(self, lines: int = 40) -> str:
        return "stdout:\n" + "".join(self.stdout[-lines:]) + "stderr:\n" + "".join(self.stderr[-lines:])

    def wait_stderr(self, pattern: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.search(pattern, line) for line in list(self.stderr)):
                return True
            time.sleep(0.02)
        return False

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def signal(self):
        """SIGTERM, as a user stops it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def terminate(self) -> int:
        """SIGTERM, then the exit code (killed, and the test failed, if it does not exit in STOP_S)."""
        self.signal()
        try:
            return self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the server {self.args} did not exit within {STOP_S} s of SIGTERM:\n" + self.tail())

    def stop(self):
        """Stop it as a user would and check that it exited cleanly: 0, and no traceback logged."""
        code = self.terminate()
        time.sleep(0.2)  # the readers' last lines
        assert code == 0, f"the server {self.args} exited with {code}:\n" + self.tail()
        log = "".join(self.stderr)
        assert "Traceback" not in log, "the server logged a traceback:\n" + log
        assert "jaxdecode: server stopped" in "".join(self.stdout), self.tail()


def client(server, key="unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=REQUEST_S, **kw)


# ----------------------------------------------------------------------------- what generate says


FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def expect(lm, prompt: str, max_tokens: int, seed: int, n: int = 1, stop=None, temperature=None, **rule):
    """``[(text, finish_reason, Generation)]``: what the server must answer for a request, from
    :func:`jaxdecode.generate` with the same seed and settings (the stop string that ended a text
    cut from it, as OpenAI's API does; ``generate`` keeps it)."""
    settings = dict(rule)
    greedy = temperature == 0
    if temperature is not None and not greedy:
        settings["temperature"] = temperature
    gens = jaxdecode.generate(lm, prompt, n=max_tokens, seed=seed, num_samples=n, greedy=greedy, stop=stop,
                              rule=jaxdecode.make_rule(**settings) if settings else None)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    out = []
    for g in gens:
        text = g.text
        if g.finish_reason == "stop":
            cut = [s for s in sorted(stops, key=len, reverse=True) if text.endswith(s)]
            assert cut, (text, stops)
            text = text[:-len(cut[0])]
        out.append((text, FINISH[g.finish_reason], g))
    return out


def completion_texts(response, count):
    """``[(text, finish_reason)]`` by choice index, checking the indices."""
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == list(range(count))
    return [(c.text, c.finish_reason) for c in choices]


# ----------------------------------------------------------------------------- raw HTTP helpers


def post(server, path, body=None, *, content=None, headers=None, timeout=REQUEST_S):
    headers = dict(headers or {})
    if content is not None:
        headers.setdefault("content-type", "application/json")
    return httpx.post(server.url + path, json=body if content is None else None, content=content,
                      headers=headers, timeout=timeout)


def sse_events(response) -> list[str]:
    """The data of every event of a server-sent event stream, checking its framing: every line is
    ``data: ...``, a blank separator, or a comment."""
    events = []
    for line in response.iter_lines():
        if not line or line.startswith(":"):
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        events.append(line[len("data: "):])
    return events


def check_error(r, status: int, param="any", code="any", says: str | None = None) -> dict:
    """``r`` is OpenAI's error JSON with ``status``; returns the error object."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert "Traceback" not in err["message"], err
    assert err["type"] == ERROR_TYPES[status], err
    if param != "any":
        assert err["param"] == param, err
    if code != "any":
        assert err["code"] == code, err
    if says is not None:
        assert says.lower() in err["message"].lower(), err
    return err


def still_serving(server, headers=None):
    """A one-token completion is answered: the server kept serving."""
    r = post(server, "/completions", {"prompt": "ROMEO:", "max_tokens": 1, "seed": 0}, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def metrics(server) -> dict[str, float]:
    """``/metrics`` as ``{sample name with its labels: value}``."""
    r = httpx.get(server.root + "/metrics", timeout=REQUEST_S)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def settle(server, timeout: float = SETTLE_S) -> dict:
    """Poll ``/metrics`` until nothing runs, nothing waits and no KV block is in use (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["jaxdecode_requests_running"] == 0 and m["jaxdecode_requests_waiting"] == 0 \
                and m["jaxdecode_kv_blocks_used"] == 0:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"the engine did not give its slots back within {timeout} s: {m}")
        time.sleep(0.05)


@contextlib.contextmanager
def serving(**servers: tuple[str, ...]):
    """``{name: ServerProcess}`` for ``name=(serve's arguments...)``; their starts overlap. Use
    ``.ready()`` on one before sending it requests."""
    procs = {name: ServerProcess(*args) for name, args in servers.items()}
    try:
        yield procs
    finally:
        for p in procs.values():
            p.signal()
        failures = []
        for name, p in procs.items():
            try:
                p.stop()
            except BaseException as e:  # stop them all, then report
                failures.append(f"{name}: {e}")
        if failures:
            raise AssertionError("\n".join(failures))
