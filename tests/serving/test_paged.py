"""The paged KV cache: the host-side block allocator (property test over 1,000 random requests with
a simulated device pool), paged attention on every implementation against attention written out
plainly here (one row, head and query at a time, keys read through the tables one position at a
time), the paged decoding model against the dense one in the decoding loops, and the serving
operations against a plain numpy forward of each sequence. The references share no code with the
model: a bug in its attention (which the dense model shares) fails them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.models.charlm import transformer as M
from jaxdecode.decoding.beam import beam_search
from jaxdecode.models.charlm.decoder import CharLMDecoder
from jaxdecode.decoding.sampling import sample_tokens
from jaxdecode.serving.blocks import BlockAllocator, OutOfBlocks
from jaxdecode.models.base import Int8Blocks, dequantize, empty_blocks, quantize, write_blocks
from jaxdecode.models.charlm.paged import (
    PagedCharLM,
    PagedKV,
    cache_bytes,
    copy_blocks,
    paged_attention,
    query_limits,
    write_cache,
)

# ----------------------------------------------------------------------------- the allocator


class Device:
    """A stand-in for the device pool: each slot holds the token written there, so a table that
    reads back anything but its sequence's tokens means blocks were shared or reused wrongly."""

    def __init__(self, alloc: BlockAllocator):
        self.a = alloc
        self.slots = np.full((alloc.num_blocks, alloc.block_size), -1, np.int64)

    def copy(self, copies):
        if copies:
            src, dst = map(list, zip(*copies))
            self.slots[dst] = self.slots[src]  # every source read before any write

    def write(self, seq, start):
        """Write the tokens of ``seq`` from position ``start`` on (only into blocks it owns alone)."""
        bs, table, toks = self.a.block_size, self.a.table(seq), self.a.tokens(seq)
        for p in range(start, len(toks)):
            b = table[p // bs]
            assert self.a.refcount(b) == 1, f"position {p} of {seq!r} written into shared block {b}"
            self.slots[b, p % bs] = toks[p]

    def verify(self, seq):
        bs, table, toks = self.a.block_size, self.a.table(seq), self.a.tokens(seq)
        got = [self.slots[table[p // bs], p % bs] for p in range(len(toks))]
        assert got == toks, f"{seq!r} reads back {got}, holds {toks}"


@pytest.mark.quick
def test_allocate_append_free_and_errors():
    a = BlockAllocator(6, 4)
    al = a.allocate("x", [1, 2, 3, 4, 5])
    assert len(al.blocks) == 2 and al.cached == 0 and a.num_free == 4
    assert a.append("x", [6, 7, 8]) == [] and len(a.table("x")) == 2  # fills the second block
    a.append("x", 9)
    assert len(a.table("x")) == 3 and a.length("x") == 9
    a.check()
    before = (a.num_free, a.table("x"))
    with pytest.raises(OutOfBlocks) as e:
        a.allocate("y", list(range(13)))  # 4 blocks, 3 free
    assert e.value.needed == 4 and e.value.free == 3 and "out of KV cache blocks" in str(e.value)
    assert (a.num_free, a.table("x")) == before and "y" not in a
    a.allocate("z", [1, 2, 3, 4, 5])
    with pytest.raises(OutOfBlocks, match="sequence 'x' needs 2 more, 1 free"):
        a.append("x", list(range(8)))  # 17 tokens: 5 blocks
    assert a.table("x") == before[1] and a.length("x") == 9
    a.free("z")
    with pytest.raises(ValueError, match="more than the whole pool of 6"):
        a.allocate("y", [1, 2], max_new_tokens=23)  # 25 tokens: 7 blocks
    with pytest.raises(ValueError, match="more than the whole pool"):
        a.append("x", list(range(16)))
    with pytest.raises(ValueError, match="already has blocks"):
        a.allocate("x", [1])
    with pytest.raises(KeyError, match="unknown sequence 'z'"):
        a.free("z")
    with pytest.raises(ValueError, match="positive integer"):
        BlockAllocator(0, 4)
    with pytest.raises(ValueError, match="1-d"):
        a.allocate("w", [[1, 2]])
    a.free("x")
    assert a.num_free == 6 and all(a.refcount(b) == 0 for b in range(6))
    a.check()


@pytest.mark.quick
def test_fork_copy_on_write_and_reorder():
    a = BlockAllocator(8, 4)
    d = Device(a)
    a.allocate("p", [1, 2, 3, 4, 5, 6])
    d.write("p", 0)
    a.fork("p", "q")
    assert a.table("p") == a.table("q") and all(a.refcount(b) == 2 for b in a.table("p"))
    last = a.table("p")[-1]
    copies = a.append("q", 7)  # the shared, partly filled last block is copied first
    assert len(copies) == 1 and copies[0][0] == last and a.table("q")[-1] == copies[0][1]
    d.copy(copies)
    d.write("q", 6)
    assert a.append("p", 8) == []  # p now owns its last block alone
    d.write("p", 6)
    for s in "pq":
        d.verify(s)
    assert a.table("p")[0] == a.table("q")[0] and a.refcount(a.table("p")[0]) == 2
    a.reorder(["p", "q"], [1, 1])  # both become q
    assert a.tokens("p") == a.tokens("q") == [1, 2, 3, 4, 5, 6, 7]
    a.check()
    a.append("p", 9)  # ... a full-block boundary is not crossed: copy on write again
    a.check()
    with pytest.raises(ValueError, match="parent index 2"):
        a.reorder(["p", "q"], [0, 2])
    with pytest.raises(ValueError, match="named twice"):
        a.reorder(["p", "p"], [0, 1])
    a.free("p")
    a.free("q")
    assert a.num_free == 8
    a.check()


def test_reserve_gives_blocks_before_the_tokens_are_known():
    """A device call that writes several decode steps gets its blocks first (reserve), the tokens
    come after (append takes no block for them), and a shared, partly filled block is copied at the
    reservation, never again."""
    a = BlockAllocator(10, 4)
    d = Device(a)
    a.allocate("p", [1, 2, 3, 4, 5, 6])
    d.write("p", 0)
    a.mark_computed("p")
    a.fork("p", "q")
    last = a.table("q")[-1]
    copies = a.reserve("q", 5)  # positions 6..10: the shared block 1 copied, one new block
    assert len(copies) == 1 and copies[0][0] == last and len(a.table("q")) == 3
    assert a.length("q") == 6 and a.num_free == 10 - 2 - 2
    a.check()
    d.copy(copies)
    table = a.table("q")
    assert a.reserve("q", 3) == [] and a.table("q") == table  # already covered
    assert a.append("q", [7, 8]) == [] and a.table("q") == table
    d.write("q", 6)
    assert a.append("q", [9, 10, 11]) == [] and a.table("q") == table  # the rest of the reservation
    d.write("q", 8)
    a.check()
    a.append("q", 12)  # past the reservation: one more block, as append always did
    d.write("q", 11)
    assert len(a.table("q")) == 3 and a.tokens("q") == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    for s in "pq":
        d.verify(s)
    a.reserve("p", 6)  # two blocks reserved, then given back by a truncate
    a.check()
    a.truncate("p", 6)
    assert len(a.table("p")) == 2
    a.check()
    with pytest.raises(OutOfBlocks):
        a.reserve("p", 4 * 8)  # more than the free blocks: nothing changes
    assert len(a.table("p")) == 2
    with pytest.raises(ValueError, match="more than the whole pool"):
        a.reserve("p", 4 * 10)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        a.reserve("p", -1)
    a.check()
    # forked after its reservation: the reserved, partly filled block is shared again, so the next
    # append still copies it before writing (a reservation is no exemption from copy on write)
    a.allocate("r", [1, 2, 3, 4, 5])
    a.reserve("r", 2)
    a.fork("r", "s")
    shared = a.table("r")[-1]
    copies = a.append("r", [6])
    assert len(copies) == 1 and copies[0][0] == shared and a.table("r")[-1] != shared == a.table("s")[-1]
    assert a.append("r", [7]) == [] and a.tokens("r") == [1, 2, 3, 4, 5, 6, 7]
    a.check()


@pytest.mark.quick
def test_prefix_sharing():
    a = BlockAllocator(16, 4)
    d = Device(a)
    prompt = list(range(10))
    assert a.allocate("a", prompt).cached == 0
    d.write("a", 0)
    # not shared before the caller says its keys and values are written
    assert a.allocate("early", prompt).cached == 0
    a.free("early")
    a.mark_computed("a")
    b = a.allocate("b", prompt[:8] + [50, 51])
    assert b.cached == 8 and list(b.blocks[:2]) == a.table("a")[:2] and b.blocks[2] != a.table("a")[2]
    d.write("b", 8)
    d.verify("b")
    # the last prompt token is never taken from the cache: a prompt of exactly two full blocks
    assert a.allocate("c", prompt[:8]).cached == 4
    # a different first block shares nothing, even with equal later blocks (the key is the prefix)
    assert a.allocate("e", [99, 1, 2, 3] + prompt[4:]).cached == 0
    for s in ("a", "b", "c", "e"):
        a.free(s)
    a.check()
    # freed blocks keep their prefix until they are reused
    assert a.allocate("f", prompt).cached == 8
    assert a.hits == 8 + 4 + 8
    # looked up: each prompt's full blocks before its last token (a, early, b, c, e, f)
    assert a.queried == 8 + 8 + 8 + 4 + 8 + 8
    assert a.evictions == 0
    a.free("f")
    cached_blocks = len(a._block_key)
    a.allocate("big", list(range(100, 164)))  # takes every block: the cached prefix is gone
    assert a.evictions == cached_blocks > 0
    a.free("big")
    assert a.allocate("g", prompt).cached == 0
    a.free("g")
    # a cached block that is cut into and written again stops being a cached prefix
    a.allocate("h", prompt)
    d.write("h", 0)
    a.mark_computed("h")
    a.truncate("h", 6)
    a.append("h", [70, 71, 72])
    d.write("h", 6)
    a.mark_computed("h")
    i = a.allocate("i", prompt)
    assert i.cached == 4 and i.blocks[0] == a.table("h")[0]
    d.write("i", 4)
    for s in ("h", "i"):
        d.verify(s)
        a.free(s)
    a.check()
    off = BlockAllocator(16, 4, prefix_caching=False)
    off.allocate("a", prompt)
    off.mark_computed("a")
    assert off.allocate("b", prompt).cached == 0


def test_allocator_property_random_requests():
    """1,000 random requests (shared prefixes, random lengths, early stops, beams of up to 5 with
    random reorders, speculative rollbacks) through a scheduler that queues or preempts on
    OutOfBlocks. After every operation the invariants hold and the touched sequences read their
    own tokens back from the simulated pool; at the end every block is free."""
    rng = np.random.default_rng(0)
    a = BlockAllocator(96, 4)
    d = Device(a)
    prefixes = [list(rng.integers(0, 50, size=n)) for n in (0, 5, 8, 13, 16)]
    pending = []
    for r in range(1000):
        prompt = prefixes[rng.integers(len(prefixes))] + list(rng.integers(0, 50, size=rng.integers(1, 9)))
        k = int(rng.choice([1, 1, 2, 3, 5]))
        pending.append({"id": r, "prompt": prompt, "k": k, "max_new": int(rng.integers(1, 20))})
    running, stats = [], {"oob": 0, "preempt": 0, "copies": 0, "hits": 0, "finished": 0, "truncate": 0}

    def seqs(req):
        return [(req["id"], j) for j in range(req["k"])]

    def release(req):
        for s in seqs(req):
            a.free(s)

    def step_checks(touched):
        a.check()
        for s in touched:
            d.verify(s)

    def admit(req):
        s0 = (req["id"], 0)
        snapshot = (a.num_free, list(a._ref))
        try:
            al = a.allocate(s0, req["prompt"], max_new_tokens=req["max_new"])
        except OutOfBlocks:
            assert (a.num_free, list(a._ref)) == snapshot  # nothing changed
            stats["oob"] += 1
            return False
        stats["hits"] += al.cached
        # the cached prefix already holds the prompt's tokens
        got = [d.slots[al.blocks[p // 4], p % 4] for p in range(al.cached)]
        assert got == req["prompt"][:al.cached]
        d.write(s0, al.cached)
        if rng.random() < 0.7:
            a.mark_computed(s0)
        for j in range(1, req["k"]):
            a.fork(s0, (req["id"], j))
        req["new"] = 0
        step_checks(seqs(req))
        return True

    while pending or running:
        for _ in range(int(rng.integers(1, 3))):  # admit up to two requests a tick
            if pending and admit(pending[0]):
                running.append(pending.pop(0))
        for req in list(running):
            if req not in running:  # preempted earlier in this tick
                continue
            ss = seqs(req)
            if req["k"] > 1:
                a.reorder(ss, list(rng.integers(0, req["k"], size=req["k"])))
                step_checks(ss)
            try:
                for s in ss:
                    copies = a.append(s, int(rng.integers(0, 50)))
                    stats["copies"] += len(copies)
                    d.copy(copies)
                    d.write(s, a.length(s) - 1)
            except OutOfBlocks:  # preempt the youngest other request (or this one) and retry it later
                stats["oob"] += 1
                stats["preempt"] += 1
                victim = running[-1] if running[-1] is not req or len(running) == 1 else running[-2]
                release(victim)
                running.remove(victim)
                pending.insert(0, {k: v for k, v in victim.items() if k != "new"})
                step_checks([s for q in running for s in seqs(q)])
                if victim is req:
                    continue
                # this request lost its step part-way: roll its beams back to a common length
                n = min(a.length(s) for s in ss)
                for s in ss:
                    a.truncate(s, n)
                step_checks(ss)
                continue
            if rng.random() < 0.5:
                for s in ss:
                    a.mark_computed(s)
            req["new"] += 1
            if req["k"] == 1 and req["new"] > 2 and rng.random() < 0.1:  # a rollback, at times into the prompt
                s = ss[0]
                n = a.length(s)
                a.truncate(s, n - int(rng.integers(1, 3) if rng.random() < 0.6 else rng.integers(1, n)))
                req["new"] = max(0, req["new"] - 2)
                stats["truncate"] += 1
            step_checks(ss)
            if req["new"] >= req["max_new"] or rng.random() < 0.05:  # done, or stopped early
                release(req)
                running.remove(req)
                stats["finished"] += 1
                a.check()
    assert stats["finished"] == 1000
    assert a.num_free == a.num_blocks and not a.sequences()
    assert all(a.refcount(b) == 0 for b in range(a.num_blocks))
    a.check()
    # every path was exercised
    assert stats["oob"] > 0 and stats["preempt"] > 0 and stats["copies"] > 100 and stats["hits"] > 100
    assert stats["truncate"] > 10


# ----------------------------------------------------------------------------- paged attention


def _through_tables(pool, tables, length):
    """Each row's first ``length`` positions read one at a time through its table: position ``t``
    of row ``b`` is offset ``t % block_size`` of block ``tables[b, t // block_size]``.
    ``[B, H, length, D]``."""
    pool, tables = np.asarray(pool), np.asarray(tables)
    bs = pool.shape[2]
    out = np.zeros((tables.shape[0], pool.shape[1], length, pool.shape[3]), pool.dtype)
    for b in range(tables.shape[0]):
        for t in range(length):
            out[b, :, t] = pool[tables[b, t // bs], :, t % bs]
    return out


def _layout(rng, lengths, H, D, bs, Mb, spare=3):
    """A random pool and tables in shuffled block order holding rows of ``lengths`` positions, and
    the same keys and values as a dense cache ``[B, H, Mb * bs, D]``."""
    B = len(lengths)
    N = B * Mb + spare
    perm = rng.permutation(N)
    tables = perm[:B * Mb].reshape(B, Mb).astype(np.int32)
    k_pool = rng.normal(size=(N, H, bs, D)).astype(np.float32)
    v_pool = rng.normal(size=(N, H, bs, D)).astype(np.float32)
    k_dense, v_dense = _through_tables(k_pool, tables, Mb * bs), _through_tables(v_pool, tables, Mb * bs)
    # garbage in the table past each row's blocks must not matter
    used = -(-np.asarray(lengths) // bs)
    for b in range(B):
        tables[b, used[b]:] = rng.integers(-5, N + 5, size=Mb - used[b])
    return jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(tables), k_dense, v_dense


def _dense_attention(q, k, v, lim, scale):
    """Attention written plainly, in float64, one row, head and query at a time: query ``s`` of row
    ``b`` sees positions ``t < lim[b, s]`` of its row's dense keys and values (``k, v``
    ``[B, H, T, D]``; at most the ``T`` there are); softmax of the scaled dot products, the
    weighted sum of the values; zeros for a query that sees nothing."""
    q, k, v, lim = (np.asarray(a, np.float64) for a in (q, k, v, lim))
    B, H, S, D = q.shape
    out = np.zeros((B, H, S, D))
    for b in range(B):
        for h in range(H):
            for s in range(S):
                n = min(int(lim[b, s]), k.shape[2])
                if n <= 0:
                    continue
                z = np.array([q[b, h, s] @ k[b, h, t] for t in range(n)]) * scale
                w = np.exp(z - z.max())
                out[b, h, s] = sum(w[t] * v[b, h, t] for t in range(n)) / w.sum()
    return out


def _last(lengths, S):
    """``[B, S]``: the positions each of a row's last ``S`` queries sees (causal among them)."""
    return np.asarray(lengths)[:, None] - S + 1 + np.arange(S)[None, :]


@pytest.mark.quick_ids('portable')
@pytest.mark.parametrize("impl", ["portable", "native", "pallas"])
def test_paged_attention_matches_dense(impl):
    rng = np.random.default_rng(1)
    H, D, bs, Mb = 2, 16, 4, 6
    lengths, S = np.array([1, 4, 5, 21, 11]), 3
    kp, vp, tables, kd, vd = _layout(rng, lengths + S - 1, H, D, bs, Mb)  # what the S queries below see
    B = len(lengths)
    scale = 1 / np.sqrt(D)
    # one decode query per row
    q = rng.normal(size=(B, H, D)).astype(np.float32)
    out = paged_attention(jnp.asarray(q), kp, vp, tables, jnp.asarray(lengths), impl=impl)
    ref = _dense_attention(q[:, :, None], kd, vd, jnp.asarray(lengths)[:, None], scale)[:, :, 0]
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    # S new positions per row, causal among themselves (chunked prefill), and a query that sees nothing
    q4 = rng.normal(size=(B, H, S, D)).astype(np.float32)
    lim = _last(lengths + S - 1, S)
    np.testing.assert_array_equal(query_limits(jnp.asarray(lengths + S - 1), S), lim)
    lim[0, 0] = 0
    out = paged_attention(jnp.asarray(q4), kp, vp, tables, jnp.asarray(lim), impl=impl)
    ref = _dense_attention(q4, kd, vd, jnp.asarray(lim), scale)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    assert np.all(np.asarray(out)[0, :, 0] == 0)
    # lengths [B]: the queries are each row's last S positions
    L = np.minimum(lengths + S - 1, Mb * bs)
    out = paged_attention(jnp.asarray(q4), kp, vp, tables, jnp.asarray(L), impl=impl)
    ref = _dense_attention(q4, kd, vd, _last(L, S), scale)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


def _np_quantized(x):
    """The int8 round trip written out in numpy: per vector, scale = max|x| / 127, round to the
    nearest step, read back as q * scale."""
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127.0
    q = np.clip(np.round(x / np.where(scale > 0, scale, 1.0)), -127, 127)
    return q * scale, q


def test_quantize_round_trip():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 3, 16)).astype(np.float32) * rng.uniform(0.01, 10, size=(5, 3, 1)).astype(np.float32)
    x[0, 0] = 0.0  # a zero vector stays zero
    q, scale = quantize(jnp.asarray(x))
    assert q.dtype == jnp.int8 and scale.shape == (5, 3) and scale.dtype == jnp.float32
    back, q_ref = _np_quantized(x)
    np.testing.assert_array_equal(np.asarray(q), q_ref)
    np.testing.assert_allclose(np.asarray(dequantize(q, scale)), back, rtol=1e-6, atol=1e-7)
    err = np.abs(np.asarray(dequantize(q, scale)) - x)
    assert np.all(err <= np.asarray(scale)[..., None] / 2 * (1 + 1e-5))  # half a step at most
    assert np.all(np.asarray(q)[0, 0] == 0) and np.abs(np.asarray(q)).max() == 127


@pytest.mark.parametrize("impl", ["portable", "native"])
def test_int8_pool_attention_matches_dequantized_dense(impl):
    """Keys and values written into an int8 pool through block tables, then attended: the dense
    attention over the numpy round trip of each vector (positions shuffled over the blocks)."""
    rng = np.random.default_rng(4)
    H, D, bs, Mb, N = 2, 16, 4, 5, 23
    lengths, S = np.array([3, 9, 20, 1]), 2
    B = len(lengths)
    tables = rng.permutation(N)[:B * Mb].reshape(B, Mb).astype(np.int32)
    k = rng.normal(size=(B, H, Mb * bs, D)).astype(np.float32) * 3
    v = rng.normal(size=(B, H, Mb * bs, D)).astype(np.float32)
    pool = empty_blocks((N, H, bs, D), 1, "int8")
    positions = np.broadcast_to(np.arange(Mb * bs, dtype=np.int32), (B, Mb * bs))
    kp = write_blocks(pool.k[0], jnp.asarray(k), jnp.asarray(tables), jnp.asarray(positions), jnp.ones((B, Mb * bs), bool))
    vp = write_blocks(pool.v[0], jnp.asarray(v), jnp.asarray(tables), jnp.asarray(positions), jnp.ones((B, Mb * bs), bool))
    assert isinstance(kp, Int8Blocks) and kp.q.dtype == jnp.int8
    kd, vd = _np_quantized(k)[0].astype(np.float32), _np_quantized(v)[0].astype(np.float32)
    q4 = rng.normal(size=(B, H, S, D)).astype(np.float32)
    lim = _last(lengths + S - 1, S)
    lim[3, 0] = 0  # a query that sees nothing: zeros
    out = paged_attention(jnp.asarray(q4), kp, vp, jnp.asarray(tables), jnp.asarray(lim), impl=impl)
    ref = _dense_attention(q4, kd, vd, jnp.asarray(lim), 1 / np.sqrt(D))
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
    assert np.all(np.asarray(out)[3, :, 0] == 0)
    # the same keys in a float pool differ from the int8 result by the quantization only (small)
    exact = _dense_attention(q4, k, v, jnp.asarray(lim), 1 / np.sqrt(D))
    assert 0 < np.abs(np.asarray(out) - exact).max() < 0.05
    # block copies move the scales with the values
    moved = copy_blocks(PagedKV((kp,), (vp,)), tables[:, :1].reshape(-1), np.array([N - 1, N - 2, N - 3, N - 4]))
    np.testing.assert_array_equal(np.asarray(moved.k[0].q[N - 1]), np.asarray(kp.q[tables[0, 0]]))
    np.testing.assert_array_equal(np.asarray(moved.k[0].scale[N - 1]), np.asarray(kp.scale[tables[0, 0]]))
    with pytest.raises(ValueError, match="Pallas kernel reads float pools only"):
        paged_attention(jnp.asarray(q4), kp, vp, jnp.asarray(tables), jnp.asarray(lim), impl="pallas")
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        empty_blocks((N, H, bs, D), 1, "int4")


@pytest.mark.quick
def test_paged_attention_errors():
    q = jnp.zeros((2, 2, 8))
    pool = jnp.zeros((4, 2, 4, 8))
    tables = jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match="impl must be one of"):
        paged_attention(q, pool, pool, tables, jnp.ones(2, jnp.int32), impl="cuda")
    with pytest.raises(ValueError, match="pool must be"):
        paged_attention(q, jnp.zeros((4, 3, 4, 8)), jnp.zeros((4, 3, 4, 8)), tables, jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match="tables must be integer"):
        paged_attention(q, pool, pool, tables.astype(jnp.float32), jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match="lengths must be"):
        paged_attention(q, pool, pool, tables, jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="copy_blocks: 2 sources for 1"):
        copy_blocks(PagedKV((pool,), (pool,)), [0, 1], [2])


# ----------------------------------------------------------------------------- the paged model


@pytest.fixture(scope="module")
def models(tiny_model):
    cfg, params, _ = tiny_model
    return cfg, params, CharLMDecoder(cfg, native=False)


class _DenseBeams(CharLMDecoder):
    """A decoder whose beam search stays on its dense cache (the default moves it to blocks)."""

    def for_beams(self):
        return self


def test_sampling_and_beam_search_match_dense(models):
    """The loops run unchanged on the paged model (the native and Pallas attention run the same
    model code: see test_serving_operations)."""
    cfg, params, dense = models
    paged = PagedCharLM(cfg, block_size=4)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, cfg.V, size=n) for n in (1, 6, 3)]
    for greedy in (True, False):
        a = sample_tokens(dense, params, prompts, 9, jax.random.PRNGKey(5), greedy=greedy)
        b = sample_tokens(paged, params, prompts, 9, jax.random.PRNGKey(5), greedy=greedy)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.model_logprobs, b.model_logprobs, atol=1e-5)
    a = beam_search(_DenseBeams(cfg, native=False), params, prompts, 8, k=3, n_best=3)
    b = beam_search(paged, params, prompts, 8, k=3, n_best=3)
    for ha, hb in zip(a.hypotheses, b.hypotheses):
        assert [h.tokens.tolist() for h in ha] == [h.tokens.tolist() for h in hb]
        np.testing.assert_allclose([h.logprob for h in ha], [h.logprob for h in hb], atol=1e-4)


@pytest.mark.parametrize("native", [False, True], ids=["portable", "native"])
def test_beam_search_runs_on_blocks_by_default(native):
    """``beam_search`` with a dense decoder runs on its paged twin (``for_beams``, same backend),
    across block boundaries (prompts of up to 9 tokens plus 20 steps, blocks of 16), and finds the
    hypotheses the dense cache finds."""
    from jaxdecode.models.charlm.transformer import ModelConfig, init_params

    cfg = ModelConfig(V=12, T=48, d=32, L=2, heads=4)
    params = jax.tree_util.tree_map(lambda a: a * 3.0, init_params(cfg, jax.random.PRNGKey(7)))
    dec = CharLMDecoder(cfg, native=native)
    twin = dec.for_beams()
    assert isinstance(twin, PagedCharLM) and twin.attention == ("native" if native else "portable")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.V, size=n) for n in (9, 2, 5)]
    a = beam_search(_DenseBeams(cfg, native=native), params, prompts, 20, k=4, n_best=4, chunk=8)
    b = beam_search(dec, params, prompts, 20, k=4, n_best=4, chunk=8)
    for ha, hb in zip(a.hypotheses, b.hypotheses):
        assert [h.tokens.tolist() for h in ha] == [h.tokens.tolist() for h in hb]
        np.testing.assert_allclose([h.logprob for h in ha], [h.logprob for h in hb], atol=1e-4)


def _exclusive_tails(cache, bs):
    """The paged cache's invariant: the blocks a row may still write are listed by no other entry."""
    table, length = np.asarray(cache.table), np.asarray(cache.length)
    B, Mb = table.shape
    for r in range(B):
        for j in range(length[r] // bs, Mb):
            hits = np.argwhere(table == table[r, j])
            assert hits.tolist() == [[r, j]], f"row {r} column {j}: block {table[r, j]} at {hits.tolist()}"


@pytest.mark.quick
def test_reorder_truncate_extend_match_dense(models):
    """Rows of different lengths reordered (duplicated, swapped), rolled back and extended: the
    paged cache gives the dense cache's logits, and rows share their full blocks."""
    cfg, params, dense = models
    bs = 4
    paged = PagedCharLM(cfg, block_size=bs)
    rng = np.random.default_rng(3)
    B, P = 4, 6
    lengths = jnp.asarray([6, 2, 5, 3], jnp.int32)
    tokens = jnp.asarray(rng.integers(0, cfg.V, size=(B, P)), jnp.int32)
    jit = lambda f: jax.jit(f, static_argnums=0)
    prefill = jit(lambda m, t, n: m.prefill(params, t, n, cfg.T)[::2])
    extend = jit(lambda m, c, t: m.extend(params, c, t)[::2])
    reorder = jit(lambda m, c, r: m.reorder(c, r))
    truncate = jit(lambda m, c, n: m.truncate(c, n))
    la, ca = prefill(dense, tokens, lengths)
    lb, cb = prefill(paged, tokens, lengths)
    np.testing.assert_allclose(la, lb, atol=1e-5)
    ops = [("reorder", [0, 0, 2, 1]), ("extend", 2), ("reorder", [3, 2, 1, 0]), ("extend", 2),
           ("truncate", [1, 3, 0, 2]), ("extend", 2), ("reorder", [1, 1, 1, 3]), ("extend", 2),
           ("reorder", [2, 0, 3, 1]), ("truncate", [0, 1, 2, 1]), ("extend", 2)]
    for op, arg in ops:
        if op == "reorder":
            ca, cb = reorder(dense, ca, jnp.asarray(arg)), reorder(paged, cb, jnp.asarray(arg))
        elif op == "truncate":
            n = jnp.asarray(np.asarray(ca.length) - np.asarray(arg), jnp.int32)
            ca, cb = truncate(dense, ca, n), truncate(paged, cb, n)
        else:
            t = jnp.asarray(rng.integers(0, cfg.V, size=(B, arg)), jnp.int32)
            (la, ca), (lb, cb) = extend(dense, ca, t), extend(paged, cb, t)
            np.testing.assert_allclose(la, lb, atol=1e-5, err_msg=f"after {op} {arg}")
        np.testing.assert_array_equal(ca.length, cb.length)
        _exclusive_tails(cb, bs)
    assert int(cb.length.max()) <= cfg.T
    # reordered rows share full blocks instead of copying them
    table = np.asarray(cb.table)
    assert len({int(b) for r in range(B) for b in table[r, :int(cb.length[r]) // bs]}) < int(
        sum(np.asarray(cb.length) // bs))


def _plain_forward(params, cfg, tokens):
    """The character model's logits at every position of one sequence, written out in numpy
    (float64, one position and head at a time): token and position embeddings; per layer a
    pre-norm causal self-attention and a pre-norm GELU feed-forward, each added to its input; the
    final LayerNorm; logits against the token embeddings."""
    from scipy.special import erf

    P = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)

    def ln(x, p):
        m, var = x.mean(-1, keepdims=True), ((x - x.mean(-1, keepdims=True)) ** 2).mean(-1, keepdims=True)
        return (x - m) / np.sqrt(var + 1e-5) * p["scale"] + p["bias"]

    dense = lambda x, p: x @ p["kernel"] + p["bias"]
    t, H, hd = len(tokens), cfg.heads, cfg.d // cfg.heads
    h = P["tok"]["embedding"][np.asarray(tokens)] + P["pos"]["embedding"][:t]
    for i in range(cfg.L):
        b = P[f"block_{i}"]
        qkv = dense(ln(h, b["ln1"]), b["attn"]["qkv"]).reshape(t, 3, H, hd)
        out = np.zeros((t, H, hd))
        for s in range(t):
            for j in range(H):
                z = np.array([qkv[s, 0, j] @ qkv[u, 1, j] for u in range(s + 1)]) / np.sqrt(hd)
                w = np.exp(z - z.max())
                out[s, j] = (w / w.sum()) @ qkv[:s + 1, 2, j]
        h = h + dense(out.reshape(t, H * hd), b["attn"]["proj"])
        x = dense(ln(h, b["ln2"]), b["ff1"])
        h = h + dense(0.5 * x * (1 + erf(x / np.sqrt(2))), b["ff2"])
    return ln(h, P["ln"]) @ P["tok"]["embedding"].T


_pool_prefill = jax.jit(PagedCharLM.pool_prefill, static_argnums=0)


@pytest.mark.parametrize("attention", ["portable", "native", "pallas"])
def test_serving_operations(models, attention):
    """What an engine does: allocate blocks on the host, prefill a request into its blocks, reuse a
    cached prefix (the rest of that prompt as one chunk), chunked prefill beside other rows, fork
    beams with copy on write, batched decode steps through the tables, idle slots; every pass
    is one program of 5 slots x 5 positions, checked against a plain numpy forward of each
    sequence (written in this file: no code of the model's)."""
    cfg, params, _ = models
    bs, width = 4, 5
    model = PagedCharLM(cfg, block_size=bs, attention=attention)
    alloc = BlockAllocator(24, bs)
    pool = model.empty_pool(24)
    rng = np.random.default_rng(4)
    slots = ["a", "b", "c", "b1", "b2"]

    def ref(tokens):  # the logits at every position of a sequence, by the plain forward
        return _plain_forward(params, cfg, tokens)

    step = jax.jit(model.pool_forward)

    def fwd(pool, work):
        """One pass: ``work`` maps a sequence to (its positions so far, its new tokens); the other
        slots idle (no tokens, a table of zeros: they must write nothing)."""
        tables = np.zeros((len(slots), width), np.int32)
        starts, counts = np.zeros(len(slots), np.int32), np.zeros(len(slots), np.int32)
        toks = np.zeros((len(slots), 5), np.int32)
        for i, name in enumerate(slots):
            if name in work:
                tables[i] = alloc.tables([name], width)[0]
                starts[i], chunk = work[name]
                counts[i] = len(chunk)
                toks[i, :len(chunk)] = chunk
        logits, _, pool = step(params, pool, jnp.asarray(tables), jnp.asarray(starts), jnp.asarray(toks),
                               jnp.asarray(counts))
        return {name: np.asarray(logits[slots.index(name), :len(work[name][1])]) for name in work}, pool

    a_prompt = list(rng.integers(0, cfg.V, size=10))
    assert alloc.allocate("a", a_prompt).cached == 0
    tok = jnp.asarray([a_prompt + [0] * 2], jnp.int32)
    logits, _, pool = _pool_prefill(PagedCharLM(cfg, bs), params, pool,
                                    jnp.asarray(alloc.tables(["a"], width)), tok, jnp.asarray([10]))
    np.testing.assert_allclose(logits[0], ref(a_prompt)[-1], atol=1e-5)
    alloc.mark_computed("a")

    # b shares a's first two blocks; c is prefilled in chunks of 5 and 4, beside b and a decode step of a
    b_prompt = a_prompt[:8] + list(rng.integers(0, cfg.V, size=3))
    c_prompt = list(rng.integers(0, cfg.V, size=9))
    assert alloc.allocate("b", b_prompt).cached == 8
    alloc.allocate("c", c_prompt)
    out, pool = fwd(pool, {"b": (8, b_prompt[8:]), "c": (0, c_prompt[:5])})
    np.testing.assert_allclose(out["b"], ref(b_prompt)[8:], atol=1e-5)
    np.testing.assert_allclose(out["c"], ref(c_prompt)[:5], atol=1e-5)
    alloc.append("a", 3)
    out, pool = fwd(pool, {"c": (5, c_prompt[5:]), "a": (10, [3])})
    np.testing.assert_allclose(out["c"], ref(c_prompt)[5:], atol=1e-5)
    np.testing.assert_allclose(out["a"], ref(alloc.tokens("a"))[-1:], atol=1e-5)

    # b becomes three beams; every step reorders them, appends a token each, copies on write
    for j in (1, 2):
        alloc.fork("b", f"b{j}")
    beams = ["b", "b1", "b2"]
    copies_seen = 0
    for _ in range(4):
        alloc.reorder(beams, list(rng.integers(0, 3, size=3)))
        new, copies = {}, []
        for s in slots:
            new[s] = int(rng.integers(0, cfg.V))
            copies += alloc.append(s, new[s])
        copies_seen += len(copies)
        if copies:
            src, dst = zip(*copies)
            pool = copy_blocks(pool, src, dst)
        out, pool = fwd(pool, {s: (alloc.length(s) - 1, [new[s]]) for s in slots})
        for s in slots:
            np.testing.assert_allclose(out[s][0], ref(alloc.tokens(s))[-1], atol=1e-5, err_msg=s)
    assert copies_seen > 0
    for s in slots:
        alloc.free(s)
    assert alloc.num_free == 24
    alloc.check()


@pytest.mark.quick
def test_write_cache_into_blocks():
    """A dense cache moved into shuffled blocks reads back through the tables up to each row's length,
    and positions past it leave the pool untouched."""
    rng = np.random.default_rng(5)
    B, H, C, D, bs = 3, 2, 10, 8, 4
    k = rng.normal(size=(B, H, C, D)).astype(np.float32)
    v = rng.normal(size=(B, H, C, D)).astype(np.float32)
    lengths = np.array([10, 3, 0])
    tables = rng.permutation(12)[:9].reshape(B, 3).astype(np.int32)
    pool = PagedKV((jnp.full((12, H, bs, D), 7.0),), (jnp.full((12, H, bs, D), 7.0),))
    out = write_cache(pool, M.KVCache((jnp.asarray(k),), (jnp.asarray(v),), jnp.asarray(lengths)), tables)
    kp, vp = np.asarray(out.k[0]), np.asarray(out.v[0])
    written = np.zeros((12, bs), bool)
    for b in range(B):
        for p in range(lengths[b]):
            blk, off = tables[b, p // bs], p % bs
            np.testing.assert_array_equal(kp[blk, :, off], k[b, :, p])
            np.testing.assert_array_equal(vp[blk, :, off], v[b, :, p])
            written[blk, off] = True
    for pool_after in (kp, vp):
        assert np.all(pool_after.transpose(0, 2, 1, 3)[~written] == 7.0)


def test_cache_bytes_and_pool_errors(models):
    cfg, _, _ = models
    per = 2 * cfg.L * cfg.d * 4
    got = cache_bytes(cfg, [5, 16, 1], block_size=4)
    assert got.blocks == 2 + 4 + 1 and got.bytes_per_position == per
    assert got.paged == 7 * 4 * per and got.contiguous == 3 * cfg.T * per
    assert got.ratio == pytest.approx(28 / 48)
    # shared prefixes: the allocator's blocks in use
    alloc = BlockAllocator(32, 4)
    alloc.allocate("x", list(range(9)))
    alloc.mark_computed("x")
    alloc.allocate("y", list(range(8)) + [20])
    shared = cache_bytes(cfg, [9, 9], block_size=4, blocks=alloc.num_used)
    assert shared.blocks == 4 and shared.paged < cache_bytes(cfg, [9, 9], block_size=4).paged
    with pytest.raises(ValueError, match="exceeds the capacity"):
        cache_bytes(cfg, [cfg.T + 1], block_size=4)
    with pytest.raises(ValueError, match="block_size must be"):
        cache_bytes(cfg, [3], block_size=0)
    with pytest.raises(ValueError, match="attention must be one of"):
        PagedCharLM(cfg, attention="gpu")
    with pytest.raises(ValueError, match="block_size must be"):
        PagedCharLM(cfg, block_size=0)
    m = PagedCharLM(cfg)
    with pytest.raises(ValueError, match="exceeds the model window"):
        m.pool_prefill(None, m.empty_pool(2), jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, cfg.T + 1), jnp.int32), [1])
