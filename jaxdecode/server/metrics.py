"""The server's Prometheus metrics (``GET /metrics``), one registry per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# latency buckets in seconds: from a fraction of a millisecond (a cached step) to a minute
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
            60.0)


class Metrics:
    """Requests running and waiting, KV blocks in use and free, prompt and generated token
    counters, the prefix cache's lookups, hits and evictions, and histograms of time to first token and time per output token."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        p = "jaxdecode_"
        self.running = Gauge(p + "requests_running", "Requests with a row in a decode slot", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Requests waiting for a decode slot", registry=r)
        self.blocks_used = Gauge(p + "kv_blocks_used", "KV cache blocks in use", registry=r)
        self.blocks_free = Gauge(p + "kv_blocks_free", "KV cache blocks free", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens read", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        # the prefix cache (vLLM's prefix_cache_queries / prefix_cache_hits, in tokens; evictions: paged blocks or dense slots)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.prefix_evictions = Counter(p + "prefix_cache_evictions",
                                        "Cached prefix blocks taken for other contents", registry=r)
        self._prefix_seen = (0, 0, 0)
        self.requests = Counter(p + "requests", "Requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Submission to first token",
                              buckets=_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_BUCKETS, registry=r)

    def add(self, stats, waiting: int = 0):
        """One turn of the engine's loop (a :class:`jaxdecode.server.runner.Stats`); ``waiting``:
        the requests submitted that the engine has not taken yet."""
        self.running.set(stats.running)
        self.waiting.set(waiting + stats.queued)
        self.blocks_used.set(stats.blocks[0])
        self.blocks_free.set(stats.blocks[1])
        for counter, now, seen in zip((self.prefix_queries, self.prefix_hits, self.prefix_evictions), stats.prefix,
                                      self._prefix_seen):
            if now > seen:
                counter.inc(now - seen)
        self._prefix_seen = tuple(max(a, b) for a, b in zip(stats.prefix, self._prefix_seen))
        if stats.prompt_tokens:
            self.prompt_tokens.inc(stats.prompt_tokens)
        if stats.generated:
            self.generation_tokens.inc(stats.generated)
        for s in stats.ttft:
            self.ttft.observe(s)
        for s in stats.tpot:
            self.tpot.observe(s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
