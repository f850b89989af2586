"""A long soak of the server with clients that leave: every block must come back and the server's
memory must stay flat (the HTTP process's and the engine process's, together).

    python -m tools.soak_server --minutes 10             # run from the repository root

``--clients`` workers send requests back to back for ``--minutes``: streamed or not, with random
lengths, seeds, settings and stop strings; a third of them leave early (a streaming client closes
after a few chunks, a non-streaming one times out). The server's resident memory (``/proc``) is
sampled every ``--every`` seconds. At the end, with no client left, ``/metrics`` must show no
request running and no KV block in use. Reports the memory after the warm-up minute and at the
end, and the counts of requests finished, abandoned and failed. The server is started and stopped
here, on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time

from benchmarks import harness as H
from benchmarks.bench_server import PROMPTS, engine_process, stop_server

_cmd_default = ["--slots", "16", "--cache", "paged"]


def server_rss_mb(pid: int, core: int | None) -> float:
    """The server's resident memory: its process and its engine's process."""
    return rss_mb(pid) + (rss_mb(core) if core is not None else 0.0)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


async def worker(http, base, deadline, rng: random.Random, counts):
    import httpx

    while time.perf_counter() < deadline:
        leave = rng.random() < 1 / 3
        stream = rng.random() < 0.5
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(8, 200), "seed": rng.randrange(1 << 30),
                "temperature": rng.choice([0.0, 0.7, 1.0]), "top_p": rng.choice([0.9, 1.0]), "stream": stream,
                "stop": rng.choice([None, "\n\n", ["\n", "!"]])}
        try:
            if stream:
                async with http.stream("POST", f"{base}/completions", json=body, timeout=120) as resp:
                    chunks = 0
                    async for line in resp.aiter_lines():
                        chunks += line.startswith("data: ")
                        if leave and chunks >= 3:
                            break
                counts["left" if leave else "done"] += 1
            else:
                timeout = rng.uniform(0.05, 0.5) if leave else 120
                resp = await http.post(f"{base}/completions", json=body, timeout=timeout)
                counts["done" if resp.status_code == 200 else "failed"] += 1
        except httpx.TimeoutException:
            counts["left" if leave else "failed"] += 1
        except (httpx.HTTPError, OSError):
            counts["failed"] += 1


async def soak(base, proc, minutes, clients, every, seed):
    import httpx

    core = engine_process(proc.pid)
    counts = {"done": 0, "left": 0, "failed": 0}
    samples = []
    start = time.perf_counter()
    deadline = start + 60 * minutes
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients * 2)) as http:
        tasks = [asyncio.ensure_future(worker(http, base, deadline, random.Random(seed + k), counts))
                 for k in range(clients)]
        while time.perf_counter() < deadline:
            samples.append((time.perf_counter() - start, server_rss_mb(proc.pid, core)))
            await asyncio.sleep(every)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)
        metrics = ""
        for _ in range(100):  # at most 20 s for the last aborted rows to leave
            metrics = (await http.get(base.removesuffix("/v1") + "/metrics", timeout=10)).text
            if metric(metrics, "jaxdecode_requests_running") == 0 and metric(metrics, "jaxdecode_kv_blocks_used") == 0:
                break
            await asyncio.sleep(0.2)
    samples.append((time.perf_counter() - start, server_rss_mb(proc.pid, core)))
    return counts, samples, metrics


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--clients", type=int, default=24)
    p.add_argument("--every", type=float, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=H.default_out("soak_server"), help="the result file")
    p.add_argument("server_args", nargs="*", default=_cmd_default,
                   help="after --: the server's flags (default: --slots 16 --cache paged)")
    args = p.parse_args()
    cmd = [sys.executable, "-m", "jaxdecode.cli", "serve", "--port", "0", *args.server_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = None
    for _ in range(600):
        line = proc.stdout.readline()
        if " at http://" in line:
            base = line.strip().split(" at ")[-1]
            break
    if base is None:
        proc.kill()
        raise SystemExit("the server did not start")
    try:
        counts, samples, metrics = asyncio.run(soak(base, proc, args.minutes, args.clients, args.every, args.seed))
    finally:
        code = stop_server(proc)
    warm = next((m for t, m in samples if t >= 60), samples[0][1])
    result = {"command": H.command("tools.soak_server"), "machine": H.machine(), "server": cmd[3:],
              "minutes": args.minutes, "clients": args.clients, "requests": counts,
              "rss_mb_after_warmup": warm, "rss_mb_end": samples[-1][1], "rss_growth_mb": samples[-1][1] - warm,
              "running_at_end": metric(metrics, "jaxdecode_requests_running"),
              "kv_blocks_used_at_end": metric(metrics, "jaxdecode_kv_blocks_used"),
              "kv_blocks_free_at_end": metric(metrics, "jaxdecode_kv_blocks_free"),
              "generated_tokens": metric(metrics, "jaxdecode_generation_tokens_total"),
              "server_exit_code": code, "rss_samples": samples}
    print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}))
    H.write_json(args.out, result)


if __name__ == "__main__":
    main()
