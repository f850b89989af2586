"""The server against the in-process engine on the same requests: throughput, time to first token
and inter-token latency (p50, p99), with Poisson arrivals up to saturation.

    python -m benchmarks.bench_server [--ckpt FOLDER] [--slots 32] [--client raw|httpx] [--out FILE]

For each arrival rate, the same requests (prompts, lengths, seeds) are served twice:

- **engine**: ``Engine.run`` in this process, each request arriving at its time (the engine's own
  clock), with the server's settings (the same slots and rule layout);
- **server**: ``jaxdecode serve`` in a subprocess on 127.0.0.1, one streaming HTTP client per
  request (asyncio) sent at its arrival time; a token's time is when its chunk arrives.

Each rate runs ``--rounds`` times, the two arms alternating (the machine's load drifts). Every
arm's CPU time is counted per process (the benchmark's own, which runs the clients or the
in-process engine; the server's HTTP process; its engine process), per generated token.

``--pin`` adds a saturation row with the engine on CPU 0 in both arms (the in-process engine, and
the server's engine process) and everything else (the server's HTTP process, the clients) on
CPU 1: the server's cost when the engine has the same core to itself in both arms.

The clients (``--client``): bare asyncio connections by default, which read the chunked event
stream by hand at a fraction of httpx's CPU time per token (on two cores the load generator's
time is taken from the server); ``--client httpx`` for httpx's streaming client.

The result file holds one result per model (``char``, ``bpe``, else the folder's name); a run
replaces its model's.

Then ``--clients`` (default 256) concurrent streaming clients at once, each checked to complete
with no error. Every loop is bounded in count and time. The server is started (``--warm-up``: no
compiling inside a timed run) and stopped here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from urllib.parse import urlsplit

import numpy as np

from benchmarks import harness as H

PROMPTS = ["ROMEO:\nIs the day so young? ", "JULIET:\nWhat's in a name? That which we call a rose ",
           "KING RICHARD II:\nNo matter where; of comfort no man speak: ", "MENENIUS:\nWhat work's, my countrymen, ",
           "First Citizen:\nBefore we proceed any further, hear me speak. ", "DUKE VINCENTIO:\nBe absolute for death; ",
           "LADY CAPULET:\nWell, think of marriage now; ", "GLOUCESTER:\nNow is the winter of our discontent "]


def make_requests(count: int, rate: float, seed: int, n_range=(32, 128)):
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, count) if rate > 0 else np.zeros(count)
    arrivals = np.cumsum(gaps) - gaps[0]
    return [dict(i=i, prompt=PROMPTS[i % len(PROMPTS)], n=int(rng.integers(*n_range)),
                 seed=int(rng.integers(1 << 30)), arrival=float(arrivals[i])) for i in range(count)]


_ENGINES: dict = {}


def engine_run(lm, reqs, slots: int) -> dict:
    """The requests through one in-process engine (kept across calls), its programs compiled
    first; CPU time counted around the run alone."""
    from jaxdecode.serving.engine import Engine, Request
    from jaxdecode.server.handlers import server_layout

    if slots not in _ENGINES:
        _ENGINES[slots] = Engine(lm, slots, layout=server_layout(lm.decoder.V))
    engine = _ENGINES[slots]
    engine.warm_up([Request(r["prompt"], r["n"], seed=r["seed"]) for r in reqs])
    with CPUClock({"bench (engine)": os.getpid()}) as clock:
        report = engine.run([Request(r["prompt"], r["n"], seed=r["seed"], arrival=r["arrival"]) for r in reqs])
    res = report.results
    tokens = sum(r.tokens for r in res)
    span = max(r.finish for r in res) - min(r.arrival for r in res)
    itl = []
    for r in res:  # the engine records a request's first and last token; inter-token: their mean gap
        if r.tpot is not None:
            itl.append(r.tpot)
    return {"tokens": tokens, "seconds": span, "throughput": tokens / span,
            "ttft": _pct([r.ttft for r in res]), "itl_mean_per_request": _pct(itl),
            "cpu_us_per_token": clock.per_token_us(tokens), "texts": [g.text for r in res for g in r.outputs]}


def _pct(values) -> dict:
    v = [x for x in values if x is not None]
    return {"p50": float(np.percentile(v, 50)) if v else None, "p99": float(np.percentile(v, 99)) if v else None}


class _Stream:
    """One streaming completion: its state as its lines arrive, whichever client reads them."""

    def __init__(self, r):
        self.r, self.times, self.text, self.error, self.tokens = r, [], "", None, 0

    def line(self, line: str) -> bool:
        """Take one line of the event stream; False once the stream has ended in an error event."""
        if not line.startswith("data: ") or line == "data: [DONE]":
            return True
        chunk = json.loads(line[6:])
        if "error" in chunk:  # the server's error event ends the stream
            self.error = f"error event: {chunk['error'].get('message')}"
            return False
        if chunk.get("usage"):
            self.tokens = chunk["usage"]["completion_tokens"]
        if chunk["choices"]:
            piece = chunk["choices"][0]["text"]
            if piece:  # a chunk may carry several tokens (a stream that fell behind sends them together)
                self.times.append((time.perf_counter(), len(piece)))
                self.text += piece
        return True


def _body(r) -> dict:
    return {"prompt": r["prompt"], "max_tokens": r["n"], "seed": r["seed"], "stream": True,
            "stream_options": {"include_usage": True}}


async def _httpx_client(http, base, st: _Stream, timeout):
    import httpx

    try:
        async with http.stream("POST", f"{base}/completions", json=_body(st.r), timeout=timeout) as resp:
            if resp.status_code != 200:
                st.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not st.line(line):
                    break
    except (httpx.HTTPError, OSError) as e:
        st.error = f"{type(e).__name__}: {e}"


async def _raw_client(base, st: _Stream):
    """The same request over a bare asyncio connection (HTTP/1.1, one connection per request, the
    chunked body read by hand): a load generator that costs a fraction of httpx's CPU time per
    token, since on two cores its time is taken from the server."""
    url = urlsplit(base)
    payload = json.dumps(_body(st.r)).encode()
    try:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
    except OSError as e:
        st.error = f"{type(e).__name__}: {e}"
        return
    try:
        writer.write(f"POST {url.path}/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + payload)
        await writer.drain()
        status = (await reader.readline()).split()
        headers = {}
        while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip().lower()
        if len(status) < 2 or status[1] != b"200":
            code = status[1].decode() if len(status) > 1 else "(no status line)"
            st.error = f"HTTP {code}: {(await reader.read(200))!r}"
            return
        rest = b""
        async for piece in _body_pieces(reader, headers):
            *lines, rest = (rest + piece).split(b"\n")
            for line in lines:
                if not st.line(line.rstrip(b"\r").decode()):
                    return
        if rest.strip():
            st.line(rest.rstrip(b"\r").decode())
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        st.error = f"{type(e).__name__}: {e}"
    finally:
        writer.close()


async def _body_pieces(reader, headers):
    """A response body's bytes as they arrive: chunked, of a stated length, or up to the close."""
    if headers.get("transfer-encoding") == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # (trailers)
                    pass
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while piece := await reader.read(65536):
            yield piece


async def _client(http, base, r, t0, out, timeout):
    await asyncio.sleep(max(0.0, t0 + r["arrival"] - time.perf_counter()))
    sent = time.perf_counter()
    st = _Stream(r)
    if http is None:
        await _raw_client(base, st)
    else:
        await _httpx_client(http, base, st, timeout)
    out.append({"sent": sent, "times": st.times, "text": st.text, "error": st.error, "i": r["i"],
                "tokens": st.tokens})


async def _load(base, reqs, timeout, limit, client):
    out: list = []
    if client == "raw":
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*[_client(None, base, r, t0, out, timeout) for r in reqs]),
                               timeout=timeout)
        return out
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)) as http:
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*[_client(http, base, r, t0, out, timeout) for r in reqs]),
                               timeout=timeout)
    return out


def server_run(base, reqs, timeout=600.0, limit=512, client="raw") -> dict:
    out = asyncio.run(_load(base, reqs, timeout, limit, client))
    errors = [o["error"] for o in out if o["error"]]
    done = [o for o in out if not o["error"] and o["times"]]
    if not done:  # every client failed: say how, instead of failing on the empty timings
        return {"tokens": 0, "seconds": 0.0, "throughput": 0.0, "errors": len(errors), "first_errors": errors[:3]}
    tokens = sum(o["tokens"] for o in done)  # the usage chunk's completion tokens
    span = max(o["times"][-1][0] for o in done) - min(o["sent"] for o in done)
    # inter-token latency: a chunk of c tokens after a gap g counts as c gaps of g / c
    itl = [(b - a) / c for o in done for (a, _), (b, c) in zip(o["times"], o["times"][1:]) for _ in range(c)]
    return {"tokens": tokens, "seconds": span, "throughput": tokens / span, "errors": len(errors),
            "first_errors": errors[:3], "ttft": _pct([o["times"][0][0] - o["sent"] for o in done]),
            "chunks_per_token": sum(len(o["times"]) for o in done) / max(1, tokens),
            "itl": _pct(itl), "texts": {o["i"]: o["text"] for o in out}}


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_process(server_pid: int) -> int | None:
    """The server's engine process (multiprocessing's resource tracker is a child too), or None."""
    try:
        with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
            children = [int(x) for x in f.read().split()]
        return next((c for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()), None)
    except OSError:
        return None


def pin(pid: int, cpus: set):
    """Every thread of process ``pid`` onto ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # (a thread that has just ended)
            pass


class CPUClock:
    """CPU seconds per generated token of each process of an arm, around a timed run."""

    def __init__(self, pids: dict):
        self.pids = {k: v for k, v in pids.items() if v is not None}

    def __enter__(self):
        self.start = {k: _cpu_seconds(p) for k, p in self.pids.items()}
        return self

    def __exit__(self, *exc):
        self.used = {k: _cpu_seconds(p) - self.start[k] for k, p in self.pids.items()}

    def per_token_us(self, tokens: int) -> dict:
        return {k: round(1e6 * v / max(1, tokens), 1) for k, v in self.used.items()}


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "jaxdecode.cli", "serve", "--port", "0", "--slots", str(args.slots), "--warm-up"]
    cmd += ["--ckpt", args.ckpt] if args.ckpt else []
    # the server's log to a file (a pipe nobody reads would fill and stall it)
    log = open(getattr(args, "server_log", None) or os.devnull, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.time() + 900
    while time.time() < deadline:
        line = proc.stdout.readline()
        if "serving" in line and "http://" in line:
            return proc, line.strip().split(" at ")[-1]
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("the server did not start")


def stop_server(proc: subprocess.Popen):
    """SIGTERM, then the exit code (None, and killed, if it has not exited within a minute)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", default=None)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--rates", default="2,8,0", help="arrival rates per second; 0: all at once (saturation)")
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="runs of each rate, the arms alternating")
    p.add_argument("--pin", action="store_true",
                   help="also saturation with the engine on CPU 0 in both arms, the rest on CPU 1")
    p.add_argument("--out", default=H.default_out("bench_server"), help="the result file")
    p.add_argument("--server-log", default=None, help="write the server's log (stderr) here")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw",
                   help="the load generator: bare asyncio connections (default) or httpx")
    args = p.parse_args()
    import jaxdecode

    load_before = H.load()
    lm = jaxdecode.load(args.ckpt)
    proc, base = start_server(args)
    core = engine_process(proc.pid)
    me = os.getpid()
    rows = []
    try:
        server_run(base, make_requests(args.slots, 0, args.seed + 99), client=args.client)  # (warm: HTTP too)
        plan = [(float(x), False) for x in args.rates.split(",")] + ([(0.0, True)] if args.pin else [])
        for rate, pinned in plan:
            reqs = make_requests(args.requests, rate, args.seed)
            if pinned:
                pin(proc.pid, {1}), pin(core, {0})
            for round_ in range(args.rounds):
                if pinned:
                    pin(me, {0})
                eng_load = H.load()[0]
                eng = engine_run(lm, reqs, args.slots)
                eng["load_before_and_after"] = [eng_load, H.load()[0]]
                if pinned:
                    pin(me, {1})
                srv_load = H.load()[0]
                with CPUClock({"bench (clients)": me, "server http": proc.pid, "server engine": core}) as cs:
                    srv = server_run(base, reqs, client=args.client)
                srv["load_before_and_after"] = [srv_load, H.load()[0]]
                differ = [r["i"] for r, t in zip(reqs, eng["texts"]) if srv["texts"].get(r["i"]) != t]
                same = len(reqs) - len(differ)
                if differ:  # the server's seeded texts must be the engine's: say so where it shows
                    print(f"requests whose server text is not the engine's: {differ}", file=sys.stderr, flush=True)
                eng.pop("texts"), srv.pop("texts")
                srv["cpu_us_per_token"] = cs.per_token_us(srv["tokens"])
                rows.append({"rate": rate, "pinned": pinned, "round": round_, "engine": eng, "server": srv,
                             "same_texts": same, "texts_differ": differ, "requests": len(reqs),
                             "throughput_ratio": srv["throughput"] / eng["throughput"],
                             "ttft_p50_gap_ms": 1e3 * (srv["ttft"]["p50"] - eng["ttft"]["p50"]),
                             "load": H.load()[0]})
                print(json.dumps(rows[-1]), flush=True)
        pin(me, set(range(os.cpu_count()))), pin(proc.pid, set(range(os.cpu_count())))
        if core is not None:
            pin(core, set(range(os.cpu_count())))
        many = server_run(base, make_requests(args.clients, 0, args.seed + 7, (16, 48)), client=args.client)
        many.pop("texts", None)
        clients = {"clients": args.clients, **many}
        print(json.dumps(clients), flush=True)
    finally:
        code = stop_server(proc)
    ckpt = args.ckpt or "shakespeare-char"
    result = H.result("benchmarks.bench_server", load_before=load_before, ckpt=ckpt, client=args.client,
                      slots=args.slots, rates=rows, concurrent_clients=clients, server_exit_code=code)
    H.write_json(args.out, merged(args.out, model_key(ckpt), result))


def model_key(ckpt: str) -> str:
    """A result's key in the file: ``char`` or ``bpe`` for the shipped models, else the folder's name."""
    name = os.path.basename(os.path.normpath(ckpt))
    return {"shakespeare-char": "char", "shakespeare-bpe": "bpe"}.get(name, name)


def merged(path, key: str, result: dict) -> dict:
    """The result file with ``result`` under ``key``, the other models' results kept."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        doc = {}
    return {**doc, key: result}


if __name__ == "__main__":
    main()
