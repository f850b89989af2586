// Decode attention for the XLA CPU backend: few queries per row against a long KV cache.
//
// XLA CPU lowers the attention contractions of a decode step (one query per row and head) to a
// batched matrix product over B * H tiny matrices, and it must first copy the attended prefix of
// the cache out of the larger cache buffer. This kernel instead walks each row's keys and values
// in place, up to that row's own length, and spreads the (row, head) pairs over XLA's intra-op
// thread pool.
//
// Inputs (float32 unless noted):
//   q    [B, H, S, D]  queries
//   k, v [B, H, C, D]  the main cache
//   lim  [B, S] int32  query (b, s) sees main positions t < lim[b, s]
//   k2, v2 [B * H, L, D] a second, small buffer (the current decode chunk; L may be 0)
//   n2   [B, S] int32  query (b, s) sees buffer positions t < n2[b, s]
// Output: out [B, H, S, D] = softmax(scale * q . keys) @ values over the visible positions of both
// buffers (zeros for a query that sees nothing).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float *q, *k, *v, *k2, *v2;
  const int32_t *lim, *n2;
  float* out;
  int64_t B, H, S, D, C, L;
  float scale;
};

// Head sizes that are a multiple of 8: eight-float vectors (AVX with -march=native, two SSE
// registers otherwise), four keys at a time so that the multiply-adds do not wait on each other.
typedef float v8 __attribute__((vector_size(32)));

inline v8 Load(const float* p) {
  v8 r;
  __builtin_memcpy(&r, p, sizeof r);
  return r;
}

// All eight lanes equal to a (one broadcast; `v8{} + a` would first add a to zero).
inline v8 Splat(float a) { return v8{a, a, a, a, a, a, a, a}; }

inline float Sum(v8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// Sum of each of four vectors, added in exactly Sum's order (so bit for bit the same), but
// transposed: eight shuffles and adds for the four instead of about six for each.
typedef float v4 __attribute__((vector_size(16)));
inline v4 Sum4(v8 a, v8 b, v8 c, v8 d) {
  // [a0+a4, a1+a5, a2+a6, a3+a7 | the same for b], and for c, d
  const v8 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
  // [(a0+a4)+(a1+a5), (a2+a6)+(a3+a7), the same for c | for b, for d]
  const v8 u = __builtin_shufflevector(ab, cd, 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(ab, cd, 1, 3, 9, 11, 5, 7, 13, 15);
  return __builtin_shufflevector(u, u, 0, 4, 2, 6) + __builtin_shufflevector(u, u, 1, 5, 3, 7);
}

// Lane by lane std::max(m, x). The score loops keep their running maximum this way, in a
// register: a scalar maximum read back each score just stored, and that chain of stores, loads
// and comparisons, not the multiply-adds, set the pace of the loop.
inline v4 Max4(v4 m, v4 x) { return m < x ? x : m; }
inline float Max(v4 m) { return std::max(std::max(m[0], m[1]), std::max(m[2], m[3])); }

typedef int v8i __attribute__((vector_size(32)));

// exp for x <= 0 (scores minus their maximum), Cephes' single-precision method: 2^n times a
// degree-6 polynomial on [-ln2/2, ln2/2]; within 2 ulp of std::exp down to about 1e-38.
inline v8 Exp(v8 x) {
  x = x < -87.0f ? v8{} - 87.0f : x;
  const v8 z = x * 1.44269504088896341f + 0.5f;
  v8i n = __builtin_convertvector(z, v8i);           // truncates toward zero
  n += (v8i)(__builtin_convertvector(n, v8) > z);    // ... so floor: minus one where it rounded up
  const v8 fn = __builtin_convertvector(n, v8);
  x = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  const v8 x2 = x * x;
  v8 y = x * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x2 + x + 1.0f;
  return y * (v8)((n + 127) << 23);
}

// scores[t] = exp(scores[t] - mx) for t < n; returns their sum.
inline float ExpShift(float* scores, int64_t n, float mx) {
  v8 total = {};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const v8 e = Exp(Load(scores + t) - mx);
    __builtin_memcpy(scores + t, &e, sizeof e);
    total += e;
  }
  float rest = 0.f;
  for (; t < n; ++t) rest += (scores[t] = std::exp(scores[t] - mx));
  return Sum(total) + rest;
}

template <int NV>
void Scores(const v8* qv, const float* kb, int64_t n, float* out, float& mx) {
  constexpr int64_t D = 8 * NV;
  int64_t t = 0;
  v4 m4 = {mx, mx, mx, mx};
  for (; t + 4 <= n; t += 4) {
    const float* k0 = kb + t * D;
    v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int j = 0; j < NV; ++j) {
      a0 += qv[j] * Load(k0 + 8 * j);
      a1 += qv[j] * Load(k0 + D + 8 * j);
      a2 += qv[j] * Load(k0 + 2 * D + 8 * j);
      a3 += qv[j] * Load(k0 + 3 * D + 8 * j);
    }
    const v4 r = Sum4(a0, a1, a2, a3);
    __builtin_memcpy(out + t, &r, sizeof r);
    m4 = Max4(m4, r);
  }
  mx = Max(m4);  // m4 started at mx
  for (; t < n; ++t) {
    v8 a = {};
    for (int j = 0; j < NV; ++j) a += qv[j] * Load(kb + t * D + 8 * j);
    out[t] = Sum(a);
    mx = std::max(mx, out[t]);
  }
}

template <int NV>
void Weighted(const float* w, const float* vb, int64_t n, v8* acc) {
  constexpr int64_t D = 8 * NV;
  for (int64_t t = 0; t < n; ++t) {
    const v8 wt = Splat(w[t]);
    for (int j = 0; j < NV; ++j) acc[j] += wt * Load(vb + t * D + 8 * j);
  }
}

// Softmax attention of one query over a few (keys, values, count) segments, head size D: the
// vector path for head sizes 16/32/64/128, a scalar one otherwise.
struct Segment {
  const float *k, *v;
  int64_t n;
};

template <int NV>
void AttendVec(const float* q, float scale, const Segment* segs, int nseg, float* out,
               std::vector<float>& scores) {
  int64_t total_n = 0;
  for (int i = 0; i < nseg; ++i) total_n += segs[i].n;
  scores.resize(total_n);
  v8 qv[NV];
  for (int j = 0; j < NV; ++j) qv[j] = Load(q + 8 * j) * scale;
  float mx = -INFINITY;
  for (int i = 0, at = 0; i < nseg; at += segs[i].n, ++i) Scores<NV>(qv, segs[i].k, segs[i].n, scores.data() + at, mx);
  const float total = ExpShift(scores.data(), total_n, mx);
  v8 acc[NV] = {};
  for (int i = 0, at = 0; i < nseg; at += segs[i].n, ++i) Weighted<NV>(scores.data() + at, segs[i].v, segs[i].n, acc);
  const float inv = 1.f / total;
  for (int j = 0; j < NV; ++j) {
    const v8 o = acc[j] * inv;
    __builtin_memcpy(out + 8 * j, &o, sizeof o);
  }
}

void AttendScalar(const float* q, int64_t D, float scale, const Segment* segs, int nseg, float* out,
                  std::vector<float>& scores) {
  int64_t total_n = 0;
  for (int i = 0; i < nseg; ++i) total_n += segs[i].n;
  scores.resize(total_n);
  float mx = -INFINITY;
  for (int i = 0, at = 0; i < nseg; at += segs[i].n, ++i)
    for (int64_t t = 0; t < segs[i].n; ++t) {
      float acc = 0.f;
      for (int64_t j = 0; j < D; ++j) acc += q[j] * segs[i].k[t * D + j];
      mx = std::max(mx, scores[at + t] = scale * acc);
    }
  float total = 0.f;
  for (int64_t t = 0; t < total_n; ++t) total += (scores[t] = std::exp(scores[t] - mx));
  std::fill(out, out + D, 0.f);
  for (int i = 0, at = 0; i < nseg; at += segs[i].n, ++i)
    for (int64_t t = 0; t < segs[i].n; ++t) {
      const float w = scores[at + t] / total;
      for (int64_t j = 0; j < D; ++j) out[j] += w * segs[i].v[t * D + j];
    }
}

void Attend(const float* q, int64_t D, float scale, const Segment* segs, int nseg, float* out,
            std::vector<float>& scores) {
  switch (D) {
    case 16: return AttendVec<2>(q, scale, segs, nseg, out, scores);
    case 32: return AttendVec<4>(q, scale, segs, nseg, out, scores);
    case 64: return AttendVec<8>(q, scale, segs, nseg, out, scores);
    case 128: return AttendVec<16>(q, scale, segs, nseg, out, scores);
    default: return AttendScalar(q, D, scale, segs, nseg, out, scores);
  }
}

// The same attention for the G heads of one query position (G <= 8): head g's query q[g] over
// its segments segs[g * nseg ...], whose lengths are the same for every head. A core keeps more
// reads in flight over several streams than over one, so the heads' keys are read in turn, one
// position at a time, and then their values the same way (measured from DRAM on one core:
// about 18 GB/s over one stream, 25-28 GB/s over four to eight interleaved at 256 bytes, less at
// 1-4 KB); each head's arithmetic is exactly that of AttendVec.
template <int NV>
void AttendHeadsVec(const float* const* q, int G, float scale, const Segment* segs, int nseg,
                    float* const* out, std::vector<float>& scores) {
  constexpr int64_t D = 8 * NV;
  int64_t total_n = 0;
  for (int i = 0; i < nseg; ++i) total_n += segs[i].n;
  scores.resize(G * total_n);
  v8 qv[8][NV];
  float mx[8];
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < NV; ++j) qv[g][j] = Load(q[g] + 8 * j) * scale;
    mx[g] = -INFINITY;
  }
  for (int i = 0, at = 0; i < nseg; at += segs[i].n, ++i)
    for (int64_t t = 0; t < segs[i].n; ++t)
      for (int g = 0; g < G; ++g)
        Scores<NV>(qv[g], segs[g * nseg + i].k + t * D, 1, scores.data() + g * total_n + at + t, mx[g]);
  float inv[8];
  for (int g = 0; g < G; ++g) inv[g] = 1.f / ExpShift(scores.data() + g * total_n, total_n, mx[g]);
  v8 acc[8][NV] = {};
  for (int i = 0, at = 0; i < nseg; at += segs[i].n, ++i)
    for (int64_t t = 0; t < segs[i].n; ++t)
      for (int g = 0; g < G; ++g)
        Weighted<NV>(scores.data() + g * total_n + at + t, segs[g * nseg + i].v + t * D, 1, acc[g]);
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) {
      const v8 o = acc[g][j] * inv[g];
      __builtin_memcpy(out[g] + 8 * j, &o, sizeof o);
    }
}

// AttendHeadsVec where the head size allows it (a multiple of 8 up to 128, at most 8 heads, a
// query that sees something), else one head at a time.
void AttendHeads(const float* const* q, int G, int64_t D, float scale, const Segment* segs, int nseg,
                 float* const* out, std::vector<float>& scores) {
  int64_t total_n = 0;
  for (int i = 0; i < nseg; ++i) total_n += segs[i].n;
  if (G <= 8 && total_n > 0) switch (D) {
      case 16: return AttendHeadsVec<2>(q, G, scale, segs, nseg, out, scores);
      case 32: return AttendHeadsVec<4>(q, G, scale, segs, nseg, out, scores);
      case 64: return AttendHeadsVec<8>(q, G, scale, segs, nseg, out, scores);
      case 128: return AttendHeadsVec<16>(q, G, scale, segs, nseg, out, scores);
    }
  for (int g = 0; g < G; ++g) Attend(q[g], D, scale, segs + g * nseg, nseg, out[g], scores);
}

// Decode attention of one (row, head) pair: each of its S queries over the main cache up to its
// limit and the second buffer up to its count (zeros for a query that sees nothing).
void RowHead(const Problem& p, int64_t bh, std::vector<float>& scores) {
  const int64_t b = bh / p.H, D = p.D;
  for (int64_t s = 0; s < p.S; ++s) {
    const Segment segs[2] = {
        {p.k + bh * p.C * D, p.v + bh * p.C * D, std::clamp<int64_t>(p.lim[b * p.S + s], 0, p.C)},
        {p.k2 + bh * p.L * D, p.v2 + bh * p.L * D, std::clamp<int64_t>(p.n2[b * p.S + s], 0, p.L)}};
    float* os = p.out + (bh * p.S + s) * D;
    if (segs[0].n + segs[1].n == 0)
      std::fill(os, os + D, 0.f);
    else
      Attend(p.q + (bh * p.S + s) * D, D, p.scale, segs, 2, os, scores);
  }
}

inline void Relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// The helper: one pool task that, after helping with a parallel call, waits for the next one (up
// to kStayAwake) and helps with that too, and so on. A decode pass calls a layer, then runs XLA's
// own operations on one thread for some microseconds (sampling; a speculative pass's acceptance
// test and draft) before the next layer. When each call schedules a new pool task, a pool thread
// that went to sleep in that gap can take tens of microseconds to wake on a virtual machine, while
// the calling thread does the layer's work alone: at batch 1 on two cores, the second thread of
// 3.8% of a speculative run's layer calls started 5-200 microseconds late. A task that only spun
// in the gap cut that to 1.0%, but then the next call's task could go to the other pool thread,
// asleep, and plain sampling's late starts went from 0.3-0.9% to 1.7-3.2%. With the helper, in
// the same process, batch-1 sampling ran 2-3% faster and speculative sampling 1-4% faster.
//
// A call hands its task to the helper when one is running, else schedules a task that becomes the
// helper. The hand-over is under a mutex; the helper polls a counter in between. There is at most
// one helper, so it never competes with the calling thread for a core.
struct Helper {
  std::mutex mu;
  std::shared_ptr<std::function<void()>> job;  // the latest call's task, until the helper takes it
  bool running = false;                         // a helper task is scheduled or running
  std::atomic<uint64_t> posted{0};              // tasks handed over so far
};
Helper& g_helper = *new Helper;  // never destroyed: a helper may outlive static destructors
constexpr auto kStayAwake = std::chrono::microseconds(50);

// `seen`: the hand-overs counted when this helper was scheduled; any later one is for it.
void HelperLoop(std::shared_ptr<std::function<void()>> task, uint64_t seen) {
  (*task)();
  auto until = std::chrono::steady_clock::now() + kStayAwake;
  for (int spins = 0;; ++spins) {
    if (g_helper.posted.load(std::memory_order_acquire) != seen) {
      {
        std::lock_guard<std::mutex> lock(g_helper.mu);
        seen = g_helper.posted.load(std::memory_order_relaxed);
        task = std::move(g_helper.job);
      }
      if (task) (*task)();
      until = std::chrono::steady_clock::now() + kStayAwake;
      continue;
    }
    Relax();
    if (spins % 64 == 63 && std::chrono::steady_clock::now() >= until) {
      std::lock_guard<std::mutex> lock(g_helper.mu);
      if (g_helper.posted.load(std::memory_order_relaxed) == seen) {  // nothing new: leave
        g_helper.running = false;
        g_helper.job.reset();
        return;
      }
    }
  }
}

// Runs `fn` on one more thread: the helper's, or a new pool task that becomes the helper.
void Share(ffi::ThreadPool& pool, std::function<void()> fn) {
  auto task = std::make_shared<std::function<void()>>(std::move(fn));
  uint64_t seen;
  {
    std::lock_guard<std::mutex> lock(g_helper.mu);
    if (g_helper.running) {
      g_helper.job = task;
      g_helper.posted.fetch_add(1, std::memory_order_release);
      return;
    }
    g_helper.running = true;
    seen = g_helper.posted.load(std::memory_order_relaxed);
  }
  pool.Schedule([task, seen] { HelperLoop(task, seen); });
}

// Runs the phases of `work` in order on the calling thread and up to `threads - 1` other threads
// (the helper and pool tasks). Counters live in a shared_ptr: a task that starts late finds every
// item taken and every phase done, and touches nothing else (work must capture by value).
template <typename W>
void RunPhases(ffi::ThreadPool& pool, int64_t threads, const W& work) {
  constexpr int P = W::kPhases;
  struct Counters {
    std::atomic<int64_t> next[P], done[P];
    int64_t items[P];
  };
  auto c = std::make_shared<Counters>();
  for (int i = 0; i < P; ++i) c->next[i] = 0, c->done[i] = 0, c->items[i] = work.Items(i);
  auto run = [c, work] {
    for (int i = 0; i < P; ++i) {
      for (int64_t j; (j = c->next[i].fetch_add(1)) < c->items[i];) {
        work.Run(i, j);
        c->done[i].fetch_add(1, std::memory_order_release);
      }
      for (int spins = 0; c->done[i].load(std::memory_order_acquire) < c->items[i]; ++spins)
        if (spins < 4096) Relax(); else std::this_thread::yield();
    }
  };
  if (threads > 1) Share(pool, run);
  for (int64_t t = 2; t < threads; ++t) pool.Schedule([run] { run(); });
  run();
}

// A single phase of `items` work items, for RunPhases.
template <typename F>
struct OnePhase {
  static constexpr int kPhases = 1;
  F fn;
  int64_t items;
  int64_t Items(int) const { return items; }
  void Run(int, int64_t i) const { fn(i); }
};

// Runs fn(i) for every i in [0, items) on the calling thread and up to `threads - 1` pool tasks.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t items, int64_t threads, F fn) {
  RunPhases(pool, std::min(threads, items), OnePhase<F>{fn, items});
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lim,
                               ffi::Buffer<ffi::F32> k2, ffi::Buffer<ffi::F32> v2,
                               ffi::Buffer<ffi::S32> n2, ffi::ResultBuffer<ffi::F32> out,
                               float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), k2d = k2.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || k2d.size() != 3)
    return ffi::Error::InvalidArgument("decode_attention: q and k must have rank 4, k2 rank 3");
  auto bad = [](const char* what) { return ffi::Error::InvalidArgument(what); };
  if (kd[0] != qd[0] || kd[1] != qd[1] || kd[3] != qd[3]) return bad("decode_attention: k does not match q");
  if (k2d[0] != qd[0] * qd[1] || k2d[2] != qd[3]) return bad("decode_attention: k2 does not match q");
  if (v.element_count() != k.element_count() || v2.element_count() != k2.element_count())
    return bad("decode_attention: values do not match keys");
  if (lim.element_count() != qd[0] * qd[2] || n2.element_count() != qd[0] * qd[2])
    return bad("decode_attention: lim and n2 must be [B, S]");

  const Problem p{q.typed_data(), k.typed_data(), v.typed_data(), k2.typed_data(), v2.typed_data(),
                  lim.typed_data(), n2.typed_data(), out->typed_data(),
                  qd[0], qd[1], qd[2], qd[3], kd[2], k2d[1], scale};
  const int64_t items = qd[0] * qd[1];  // (row, head) pairs
  // Threads only pay off for large problems (a task hand-off costs microseconds).
  const int64_t work = items * qd[2] * (kd[2] + k2d[1]) * qd[3];
  ParallelFor(pool, items, work >= (int64_t{1} << 20) ? pool.num_threads() : 1, [p](int64_t i) {
    thread_local std::vector<float> scores;
    RowHead(p, i, scores);
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// y = x @ w + b for a few rows: x [M, K], w [K, N], b [N], N a multiple of 8.
//
// With one or two rows the product is bound by reading w, and XLA CPU reads it on one thread.
// Here each thread streams its share of every row of w in order (the access pattern hardware
// prefetchers follow), eight rows of w at a time, into the rows of y kept hot in L1. Every row of
// x re-reads the block of w from L1, so from three rows on XLA's own product is as fast.

struct DenseProblem {
  const float *x, *w, *b;
  float* y;
  int64_t M, K, N;

  void Range(int64_t n0, int64_t n1) const {
    for (int64_t r = 0; r < M; ++r) std::copy(b + n0, b + n1, y + r * N + n0);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const float* wk = w + k * N;
      for (int64_t r = 0; r < M; ++r) {
        const float* xr = x + r * K + k;
        v8 xs[8];
        for (int j = 0; j < 8; ++j) xs[j] = Splat(xr[j]);
        float* yr = y + r * N;
        for (int64_t n = n0; n < n1; n += 8) {
          const v8 a = (xs[0] * Load(wk + n) + xs[1] * Load(wk + N + n)) +
                       (xs[2] * Load(wk + 2 * N + n) + xs[3] * Load(wk + 3 * N + n));
          const v8 c = (xs[4] * Load(wk + 4 * N + n) + xs[5] * Load(wk + 5 * N + n)) +
                       (xs[6] * Load(wk + 6 * N + n) + xs[7] * Load(wk + 7 * N + n));
          const v8 o = Load(yr + n) + (a + c);
          __builtin_memcpy(yr + n, &o, sizeof o);
        }
      }
    }
    for (; k < K; ++k) {
      const float* wk = w + k * N;
      for (int64_t r = 0; r < M; ++r) {
        const v8 xk = Splat(x[r * K + k]);
        float* yr = y + r * N;
        for (int64_t n = n0; n < n1; n += 8) {
          const v8 o = Load(yr + n) + xk * Load(wk + n);
          __builtin_memcpy(yr + n, &o, sizeof o);
        }
      }
    }
  }

};

ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || b.element_count() != wd[1] || wd[1] % 8)
    return ffi::Error::InvalidArgument("dense: expected x [M, K], w [K, N], b [N] with N % 8 == 0");
  const DenseProblem p{x.typed_data(), w.typed_data(), b.typed_data(), y->typed_data(), xd[0], xd[1], wd[1]};
  const int64_t threads = p.K * p.N >= (int64_t{1} << 16) ? std::max<int64_t>(1, pool.num_threads()) : 1;
  const int64_t cols = ((p.N / threads + 7) / 8) * 8;  // one range of columns per thread
  const int64_t items = (p.N + cols - 1) / cols;
  ParallelFor(pool, items, items, [p, cols](int64_t i) { p.Range(i * cols, std::min(p.N, (i + 1) * cols)); });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// A whole decoder layer for the rows of a decode pass (a step, a speculative verify pass):
//
//   h = LN1(x); q, k, v = split(h @ Wqkv + bqkv); x1 = x + attend(q, ...) @ Wo + bo
//   y = x1 + gelu(LN2(x1) @ W1 + b1) @ W2 + b2
//
// With a few rows a layer is bound by reading its weights (12 d^2 floats), yet XLA runs it as a
// dozen small operations of a few microseconds each. Here the layer is one call: its phases run on
// the calling thread and one pool task, which claim work items phase by phase (so a task that
// starts late, or never, only means the caller does more of the work) and wait for each other
// only between phases, spinning for the microsecond that takes. Many rows run as a pipeline
// instead (LayerPipeline, below).
//
// Inputs: x [R, d] (R = B * S, row b's S queries in order); the LayerNorm scales and biases [d];
// the dense kernels packed in panels of 16 columns (see kernels.pack) and their biases; the main
// cache k, v [B, H, C, hd] with lim [B, S]; the chunk buffer k2, v2 [B * H, L, hd] with n2 [B, S].
// Query (b, s) sees main positions t < lim[b, s], buffer positions t < n2[b, s] and the new
// positions 0..s of its own row. Outputs: y [R, d] and the new keys and values: [B, H, S, hd]
// (write 0), or written in place into the cache k, v at each row's lim[b, 0] (write 1) or into the
// buffer k2, v2 at n2[b, 0] (write 2), the outputs then being those buffers (aliased by the caller).

// Keeps a loaded vector in a register: otherwise the compiler folds the load into every
// multiply-add that uses it, and the product becomes bound by loads instead of arithmetic.
inline void InRegister(v8& x) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(x));
#else
  (void)x;
#endif
}

// With AVX-512 there are 32 vector registers: room for 16 accumulators.
#if defined(__AVX512VL__)
constexpr bool kManyRegisters = true;
#else
constexpr bool kManyRegisters = false;
#endif

// acc[r] (16 columns as two vectors) += x[r, :K] . panel; U interleaved accumulators hide the
// multiply-add latency when there are few rows.
template <int R, int U>
void PanelRows(const float* x, int64_t ldx, int64_t K, const float* panel, v8 (&acc)[R][2]) {
  v8 a[U][R][2] = {};
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int u = 0; u < U; ++u) {
      v8 w0 = Load(panel + 16 * (k + u)), w1 = Load(panel + 16 * (k + u) + 8);
      InRegister(w0), InRegister(w1);
      for (int r = 0; r < R; ++r) {
        const v8 xr = Splat(x[r * ldx + k + u]);
        a[u][r][0] += xr * w0, a[u][r][1] += xr * w1;
      }
    }
  }
  for (; k < K; ++k) {
    const v8 w0 = Load(panel + 16 * k), w1 = Load(panel + 16 * k + 8);
    for (int r = 0; r < R; ++r) {
      const v8 xr = Splat(x[r * ldx + k]);
      a[0][r][0] += xr * w0, a[0][r][1] += xr * w1;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][0] += a[u][r][0], acc[r][1] += a[u][r][1];
}

// erf for float32 (Eigen's rational approximation on [-4, 4]; within 5e-7 of erf).
inline v8 Erf(v8 x) {
  x = x > 4.f ? v8{} + 4.f : x;
  x = x < -4.f ? v8{} - 4.f : x;
  const v8 x2 = x * x;
  v8 p = x2 * -2.72614225801306e-10f + 2.77068142495902e-08f;
  p = p * x2 + -2.10102402082508e-06f;
  p = p * x2 + -5.69250639462346e-05f;
  p = p * x2 + -7.34990630326855e-04f;
  p = p * x2 + -2.95459980854025e-03f;
  p = p * x2 + -1.60960333262415e-02f;
  v8 q = x2 * -1.45660718464996e-05f + -2.13374055278905e-04f;
  q = q * x2 + -1.68282697438203e-03f;
  q = q * x2 + -7.37332916720468e-03f;
  q = q * x2 + -1.42647390514189e-02f;
  return x * p / q;
}

enum Epilogue { kPlain, kResidual, kGelu };

// y[:, cols of panels p0..p1) = x @ w + b, then plus res (kResidual) or through exact GELU (kGelu).
template <int R, int U>
void PanelsR(const float* x, int64_t K, const float* wp, const float* b, float* y, int64_t N,
             const float* res, Epilogue ep, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n = 16 * p;
    v8 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = Load(b + n), acc[r][1] = Load(b + n + 8);
    PanelRows<R, U>(x, K, K, wp + p * K * 16, acc);
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        v8 o = acc[r][h];
        if (ep == kResidual) o += Load(res + r * N + n + 8 * h);
        if (ep == kGelu) o = 0.5f * o * (1.f + Erf(o * 0.70710678118654752f));
        __builtin_memcpy(y + r * N + n + 8 * h, &o, sizeof o);
      }
  }
}

void Panels(const float* x, int64_t M, int64_t K, const float* wp, const float* b, float* y,
            int64_t N, const float* res, Epilogue ep, int64_t p0, int64_t p1) {
  int64_t r = 0;
  if (kManyRegisters) {
    // whole tiles of up to 8 rows: a tile of a remainder of 5-7 rows reads each panel once, where
    // 4 + 1 (2, 3) would read it twice (a verify pass of gamma = 4 is 5 rows)
    for (; r + 8 <= M; r += 8) PanelsR<8, 1>(x + r * K, K, wp, b, y + r * N, N, res ? res + r * N : res, ep, p0, p1);
    switch (M - r) {
      case 7: PanelsR<7, 1>(x + r * K, K, wp, b, y + r * N, N, res ? res + r * N : res, ep, p0, p1); return;
      case 6: PanelsR<6, 1>(x + r * K, K, wp, b, y + r * N, N, res ? res + r * N : res, ep, p0, p1); return;
      case 5: PanelsR<5, 1>(x + r * K, K, wp, b, y + r * N, N, res ? res + r * N : res, ep, p0, p1); return;
    }
    for (; r + 4 <= M; r += 4) PanelsR<4, 2>(x + r * K, K, wp, b, y + r * N, N, res ? res + r * N : res, ep, p0, p1);
  } else {
    for (; r + 4 <= M; r += 4) PanelsR<4, 1>(x + r * K, K, wp, b, y + r * N, N, res ? res + r * N : res, ep, p0, p1);
  }
  switch (M - r) {
    case 3: PanelsR<3, 2>(x + r * K, K, wp, b, y + r * N, N, res ? res + r * N : res, ep, p0, p1); break;
    case 2: PanelsR<2, 2>(x + r * K, K, wp, b, y + r * N, N, res ? res + r * N : res, ep, p0, p1); break;
    case 1: PanelsR<1, 4>(x + r * K, K, wp, b, y + r * N, N, res ? res + r * N : res, ep, p0, p1); break;
  }
}

// ---------------------------------------------------------------------------------------------
// y = x @ w + b for a few rows, with w packed in panels of 16 columns: wp [N / 16, K, 16] (see
// kernels.pack). A panel is read in order, once, while a tile of y stays in registers (Panels).

ffi::Error PackedDenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                           ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = wp.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != 16 || xd[1] != wd[1] || b.element_count() != 16 * wd[0])
    return ffi::Error::InvalidArgument("packed_dense: expected x [M, K], wp [N/16, K, 16], b [N]");
  const float *xs = x.typed_data(), *w = wp.typed_data(), *bias = b.typed_data();
  float* ys = y->typed_data();
  const int64_t M = xd[0], K = xd[1], panels = wd[0];
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), panels));
  const int64_t per = (panels + threads - 1) / threads;  // panels per thread
  const int64_t items = (panels + per - 1) / per;
  ParallelFor(pool, items, items, [=](int64_t i) {
    Panels(xs, M, K, w, bias, ys, 16 * panels, nullptr, kPlain, i * per, std::min(panels, (i + 1) * per));
  });
  return ffi::Error::Success();
}

void LayerNorm(const float* x, const float* g, const float* b, float eps, int64_t d, float* out) {
  // d is a multiple of 16 (checked by the caller); two passes, eight lanes each
  v8 sum = {};
  for (int64_t i = 0; i < d; i += 8) sum += Load(x + i);
  const float mean = Sum(sum) / d;
  v8 ss = {};
  for (int64_t i = 0; i < d; i += 8) {
    const v8 c = Load(x + i) - mean;
    ss += c * c;
  }
  const float inv = 1.f / std::sqrt(Sum(ss) / d + eps);
  for (int64_t i = 0; i < d; i += 8) {
    const v8 o = (Load(x + i) - mean) * inv * Load(g + i) + Load(b + i);
    __builtin_memcpy(out + i, &o, sizeof o);
  }
}

// Two queries over the same two segments of keys and values (plus one segment each of their own,
// the new positions they see): each shared key and value is read once for both.
template <int NV>
void AttendPairVec(const float* const* q, float scale, const Segment* shared, const Segment* own,
                   float* const* out, std::vector<float>& scores) {
  constexpr int64_t D = 8 * NV;
  const int64_t n_sh = shared[0].n + shared[1].n;
  const int64_t stride = n_sh + std::max(own[0].n, own[1].n);
  scores.resize(2 * stride);
  float* sc[2] = {scores.data(), scores.data() + stride};
  v8 qv[2][NV];
  for (int g = 0; g < 2; ++g)
    for (int j = 0; j < NV; ++j) qv[g][j] = Load(q[g] + 8 * j) * scale;
  float mx[2] = {-INFINITY, -INFINITY};
  for (int i = 0, at = 0; i < 2; at += shared[i].n, ++i) {
    const float* kb = shared[i].k;
    int64_t t = 0;
    v4 m4 = {mx[0], mx[0], mx[1], mx[1]};
    for (; t + 2 <= shared[i].n; t += 2) {  // two keys by two queries: four independent sums
      v8 a00 = {}, a01 = {}, a10 = {}, a11 = {};
      for (int j = 0; j < NV; ++j) {
        const v8 k0 = Load(kb + t * D + 8 * j), k1 = Load(kb + (t + 1) * D + 8 * j);
        a00 += qv[0][j] * k0, a01 += qv[0][j] * k1, a10 += qv[1][j] * k0, a11 += qv[1][j] * k1;
      }
      const v4 r = Sum4(a00, a01, a10, a11);  // [q0 k0, q0 k1, q1 k0, q1 k1]
      float rs[4];
      __builtin_memcpy(rs, &r, sizeof r);
      __builtin_memcpy(sc[0] + at + t, rs, 2 * sizeof(float));
      __builtin_memcpy(sc[1] + at + t, rs + 2, 2 * sizeof(float));
      m4 = Max4(m4, r);
    }
    mx[0] = std::max(m4[0], m4[1]);  // m4 started at mx
    mx[1] = std::max(m4[2], m4[3]);
    for (; t < shared[i].n; ++t) {
      v8 a0 = {}, a1 = {};
      for (int j = 0; j < NV; ++j) {
        const v8 k0 = Load(kb + t * D + 8 * j);
        a0 += qv[0][j] * k0, a1 += qv[1][j] * k0;
      }
      mx[0] = std::max(mx[0], sc[0][at + t] = Sum(a0));
      mx[1] = std::max(mx[1], sc[1][at + t] = Sum(a1));
    }
  }
  float inv[2];
  for (int g = 0; g < 2; ++g) {
    Scores<NV>(qv[g], own[g].k, own[g].n, sc[g] + n_sh, mx[g]);
    inv[g] = 1.f / ExpShift(sc[g], n_sh + own[g].n, mx[g]);
  }
  v8 acc[2][NV] = {};
  for (int i = 0, at = 0; i < 2; at += shared[i].n, ++i) {
    const float* vb = shared[i].v;
    for (int64_t t = 0; t < shared[i].n; ++t) {
      const v8 w0 = Splat(sc[0][at + t]), w1 = Splat(sc[1][at + t]);
      for (int j = 0; j < NV; ++j) {
        const v8 vv = Load(vb + t * D + 8 * j);
        acc[0][j] += w0 * vv, acc[1][j] += w1 * vv;
      }
    }
  }
  for (int g = 0; g < 2; ++g) {
    Weighted<NV>(sc[g] + n_sh, own[g].v, own[g].n, acc[g]);
    for (int j = 0; j < NV; ++j) {
      const v8 o = acc[g][j] * inv[g];
      __builtin_memcpy(out[g] + 8 * j, &o, sizeof o);
    }
  }
}

void AttendPair(const float* const* q, int64_t D, float scale, const Segment* shared, const Segment* own,
                float* const* out, std::vector<float>& scores) {
  switch (D / 8) {
    case 1: return AttendPairVec<1>(q, scale, shared, own, out, scores);
    case 2: return AttendPairVec<2>(q, scale, shared, own, out, scores);
    case 3: return AttendPairVec<3>(q, scale, shared, own, out, scores);
    case 4: return AttendPairVec<4>(q, scale, shared, own, out, scores);
    case 5: return AttendPairVec<5>(q, scale, shared, own, out, scores);
    case 6: return AttendPairVec<6>(q, scale, shared, own, out, scores);
    case 7: return AttendPairVec<7>(q, scale, shared, own, out, scores);
    case 8: return AttendPairVec<8>(q, scale, shared, own, out, scores);
    case 12: return AttendPairVec<12>(q, scale, shared, own, out, scores);
    case 16: return AttendPairVec<16>(q, scale, shared, own, out, scores);
    default:  // other head sizes: one query at a time
      for (int g = 0; g < 2; ++g) {
        const Segment segs[3] = {shared[0], shared[1], own[g]};
        Attend(q[g], D, scale, segs, 3, out[g], scores);
      }
  }
}

struct LayerProblem {
  const float *x, *g1, *be1, *wqkv, *bqkv, *wo, *bo, *g2, *be2, *w1, *b1, *w2, *b2;
  const float *k, *v, *k2, *v2;
  const int32_t *lim, *n2;
  float *y, *knew, *vnew;
  float *h, *qkv, *att, *x1, *f;  // scratch: [R, d], [R, 3d], [R, d], [R, d], [R, 4d]
  int64_t B, S, H, D, d, C, L;
  float scale, eps;
  int write;  // where the new keys and values go: 0 knew/vnew [B, H, S, D], 1 the cache, 2 the buffer
  int64_t R() const { return B * S; }

  // Offset (in floats) of row-head bh's first new key in knew and vnew: its S new positions are
  // consecutive. In the cache (buffer) they start at the row's first limit lim[b, 0] (count
  // n2[b, 0]), moved back to fit as XLA's dynamic_update_slice does.
  int64_t NewAt(int64_t bh) const {
    const int64_t b = bh / H;
    if (write == 1) return (bh * C + std::clamp<int64_t>(lim[b * S], 0, C - S)) * D;
    if (write == 2) return (bh * L + std::clamp<int64_t>(n2[b * S], 0, L - S)) * D;
    return bh * S * D;
  }
};

// Phase i of the layer, work item j of `items(i)`; `split` items for each dense product.
struct LayerPhases {
  LayerProblem p;
  int64_t split;
  static constexpr int kPhases = 7;

  int64_t Items(int phase) const {
    switch (phase) {
      case 0: case 4: return p.R();       // LayerNorms, one row each
      case 2: return ByRow() ? p.B : p.B * p.H;  // attention, one row or one (row, head) each
      default: return split;              // dense products, a range of panels each
    }
  }

  // Attention by rows (all heads of a row together, see RowAttention) when there are enough rows
  // to share out.
  bool ByRow() const { return p.S == 1 && p.H <= 8 && p.B >= split; }

  // panels [p0, p1) of `panels` for item j
  void Range(int64_t panels, int64_t j, int64_t& p0, int64_t& p1) const {
    p0 = panels * j / split, p1 = panels * (j + 1) / split;
  }

  void Run(int phase, int64_t j) const {
    const int64_t R = p.R(), d = p.d;
    int64_t p0, p1;
    switch (phase) {
      case 0: return LayerNorm(p.x + j * d, p.g1, p.be1, p.eps, d, p.h + j * d);
      case 1: Range(3 * d / 16, j, p0, p1);
        return Panels(p.h, R, d, p.wqkv, p.bqkv, p.qkv, 3 * d, nullptr, kPlain, p0, p1);
      case 2: return ByRow() ? RowAttention(j) : Attention(j);
      case 3: Range(d / 16, j, p0, p1);
        return Panels(p.att, R, d, p.wo, p.bo, p.x1, d, p.x, kResidual, p0, p1);
      case 4: return LayerNorm(p.x1 + j * d, p.g2, p.be2, p.eps, d, p.h + j * d);
      case 5: Range(4 * d / 16, j, p0, p1);
        return Panels(p.h, R, d, p.w1, p.b1, p.f, 4 * d, nullptr, kGelu, p0, p1);
      case 6: Range(d / 16, j, p0, p1);
        return Panels(p.f, R, 4 * d, p.w2, p.b2, p.y, d, p.x1, kResidual, p0, p1);
    }
  }

  // Row-head bh's S new keys and values, copied from the QKV product to where they go (see
  // LayerProblem::NewAt); returns their addresses.
  void PlaceNew(int64_t bh, float*& kn, float*& vn) const {
    const int64_t b = bh / p.H, hh = bh % p.H, D = p.D, S = p.S, d = p.d;
    kn = p.knew + p.NewAt(bh), vn = p.vnew + p.NewAt(bh);
    for (int64_t s = 0; s < S; ++s) {
      const float* row = p.qkv + (b * S + s) * 3 * d + hh * D;
      std::copy(row + d, row + d + D, kn + s * D);
      std::copy(row + 2 * d, row + 2 * d + D, vn + s * D);
    }
  }

  // The cache and buffer segments query s of row-head bh sees.
  void Seen(int64_t bh, int64_t s, Segment* segs) const {
    const int64_t i = bh / p.H * p.S + s, D = p.D;
    segs[0] = {p.k + bh * p.C * D, p.v + bh * p.C * D, std::clamp<int64_t>(p.lim[i], 0, p.C)};
    segs[1] = {p.k2 + bh * p.L * D, p.v2 + bh * p.L * D, std::clamp<int64_t>(p.n2[i], 0, p.L)};
  }

  // Attention of every head of row b. With one query per row the heads are attended together
  // (AttendHeads); with several, head by head (Attention).
  void RowAttention(int64_t b) const {
    if (p.S != 1 || p.H > 8) {  // several queries per row: see Attention
      for (int64_t hh = 0; hh < p.H; ++hh) Attention(b * p.H + hh);
      return;
    }
    thread_local std::vector<float> scores;
    const int64_t D = p.D, d = p.d, H = p.H;
    const float* qs[8];
    float* outs[8];
    Segment segs[8 * 3];
    for (int64_t hh = 0; hh < H; ++hh) {
      float *kn, *vn;
      PlaceNew(b * H + hh, kn, vn);
      Seen(b * H + hh, 0, segs + 3 * hh);
      segs[3 * hh + 2] = {kn, vn, 1};
      qs[hh] = p.qkv + b * 3 * d + hh * D;
      outs[hh] = p.att + b * d + hh * D;
    }
    AttendHeads(qs, static_cast<int>(H), D, p.scale, segs, 3, outs, scores);
  }

  void Attention(int64_t bh) const {
    thread_local std::vector<float> scores;
    const int64_t b = bh / p.H, hh = bh % p.H, D = p.D, S = p.S, d = p.d;
    float *kn, *vn;
    PlaceNew(bh, kn, vn);
    auto query = [&](int64_t s) { return p.qkv + (b * S + s) * 3 * d + hh * D; };
    auto out = [&](int64_t s) { return p.att + (b * S + s) * d + hh * D; };
    auto shared = [&](int64_t s, Segment* segs) { Seen(bh, s, segs); };
    int64_t s = 0;
    if (D % 8 == 0 && D <= 128) {
      // pairs of queries that see the same cache positions read those keys and values once
      for (; s + 2 <= S; s += 2) {
        if (p.lim[b * S + s] != p.lim[b * S + s + 1] || p.n2[b * S + s] != p.n2[b * S + s + 1]) break;
        Segment segs[2];
        shared(s, segs);
        const Segment own[2] = {{kn, vn, s + 1}, {kn, vn, s + 2}};
        const float* qs[2] = {query(s), query(s + 1)};
        float* outs[2] = {out(s), out(s + 1)};
        AttendPair(qs, D, p.scale, segs, own, outs, scores);
      }
    }
    for (; s < S; ++s) {
      Segment segs[3];
      shared(s, segs);
      segs[2] = {kn, vn, s + 1};
      Attend(query(s), D, p.scale, segs, 3, out(s), scores);
    }
  }
};

// The same layer for many rows, as a pipeline over blocks of rows. In a large batch, attention
// streams the cache from memory while the products are bound by arithmetic on weights held in
// cache; run as phases, the two alternate and each leaves the other's resource idle. Here every
// block of rows goes through three tasks, in order: Q (LayerNorm and the QKV product), A (its
// attention) and P (projection, LayerNorm, feed-forward). Threads claim ready tasks, blocks in
// order within each kind; the calling thread prefers products (Q, then P) and the others prefer
// attention, so that one core streams the cache while the other multiplies, and either takes the
// other's work when its own kind has none ready. As in RunPhases, a thread that starts late (or
// never) leaves more of the work to the others and cannot block them.
constexpr int64_t kPipelineRows = 64, kPipelineBlock = 16;

struct LayerPipeline {
  LayerProblem p;
  LayerPhases phases;  // for its Attention(bh)
  int64_t rows_per_block;  // a multiple of S (whole rows of the batch)

  int64_t Blocks() const { return (p.R() + rows_per_block - 1) / rows_per_block; }

  // Rows [r0, r1) of block i.
  void Rows(int64_t i, int64_t& r0, int64_t& r1) const {
    r0 = i * rows_per_block, r1 = std::min(p.R(), r0 + rows_per_block);
  }

  // y rows [r0, r1) = x rows @ w + b (+ epilogue), panel by panel so that each panel is read
  // once from the shared cache for all the block's rows.
  static void BlockProduct(const float* x, int64_t M, int64_t K, const float* wp, const float* b, float* y,
                           int64_t N, const float* res, Epilogue ep) {
    for (int64_t q = 0; q < N / 16; ++q) Panels(x, M, K, wp, b, y, N, res, ep, q, q + 1);
  }

  void Q(int64_t i) const {
    int64_t r0, r1;
    Rows(i, r0, r1);
    const int64_t d = p.d;
    for (int64_t r = r0; r < r1; ++r) LayerNorm(p.x + r * d, p.g1, p.be1, p.eps, d, p.h + r * d);
    BlockProduct(p.h + r0 * d, r1 - r0, d, p.wqkv, p.bqkv, p.qkv + r0 * 3 * d, 3 * d, nullptr, kPlain);
  }

  void A(int64_t i) const {
    int64_t r0, r1;
    Rows(i, r0, r1);
    for (int64_t b = r0 / p.S; b < r1 / p.S; ++b) phases.RowAttention(b);
  }

  void P(int64_t i) const {
    int64_t r0, r1;
    Rows(i, r0, r1);
    const int64_t d = p.d, M = r1 - r0;
    BlockProduct(p.att + r0 * d, M, d, p.wo, p.bo, p.x1 + r0 * d, d, p.x + r0 * d, kResidual);
    for (int64_t r = r0; r < r1; ++r) LayerNorm(p.x1 + r * d, p.g2, p.be2, p.eps, d, p.h + r * d);
    BlockProduct(p.h + r0 * d, M, d, p.w1, p.b1, p.f + r0 * 4 * d, 4 * d, nullptr, kGelu);
    BlockProduct(p.f + r0 * 4 * d, M, 4 * d, p.w2, p.b2, p.y + r0 * d, d, p.x1 + r0 * d, kResidual);
  }
};

void RunPipeline(ffi::ThreadPool& pool, int64_t threads, const LayerPipeline& work) {
  const int64_t n = work.Blocks();
  struct State {
    std::atomic<int64_t> next[3];  // next block to claim, per kind (Q, A, P)
    std::atomic<int64_t> finished{0};  // P tasks done
    std::unique_ptr<std::atomic<char>[]> done;  // [kind * n + block]: Q and A tasks done
  };
  auto st = std::make_shared<State>();
  for (auto& c : st->next) c = 0;
  st->done.reset(new std::atomic<char>[2 * n]);
  for (int64_t i = 0; i < 2 * n; ++i) st->done[i] = 0;
  auto run = [st, work, n](bool streams) {
    // Claims the next block of `kind` if its previous stage is done; -1 if none is ready.
    auto claim = [&](int kind) -> int64_t {
      int64_t i = st->next[kind].load(std::memory_order_relaxed);
      while (i < n && (kind == 0 || st->done[(kind - 1) * n + i].load(std::memory_order_acquire))) {
        if (st->next[kind].compare_exchange_weak(i, i + 1)) return i;
      }
      return -1;
    };
    const int order[2][3] = {{0, 2, 1}, {1, 2, 0}};  // products first / attention first
    for (int spins = 0; st->finished.load(std::memory_order_acquire) < n;) {
      bool ran = false;
      for (int kind : order[streams]) {
        const int64_t i = claim(kind);
        if (i < 0) continue;
        if (kind == 0) work.Q(i);
        if (kind == 1) work.A(i);
        if (kind == 2) work.P(i);
        if (kind < 2) st->done[kind * n + i].store(1, std::memory_order_release);
        else st->finished.fetch_add(1, std::memory_order_release);
        ran = true;
        break;
      }
      if (ran) spins = 0;
      else if (++spins < 4096) Relax();
      else std::this_thread::yield();
    }
  };
  if (threads > 1) Share(pool, [run] { run(true); });
  for (int64_t t = 2; t < threads; ++t) pool.Schedule([run] { run(true); });
  run(false);
}

ffi::Error DecodeLayerImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> g1,
                           ffi::Buffer<ffi::F32> be1, ffi::Buffer<ffi::F32> wqkv, ffi::Buffer<ffi::F32> bqkv,
                           ffi::Buffer<ffi::F32> wo, ffi::Buffer<ffi::F32> bo, ffi::Buffer<ffi::F32> g2,
                           ffi::Buffer<ffi::F32> be2, ffi::Buffer<ffi::F32> w1, ffi::Buffer<ffi::F32> b1,
                           ffi::Buffer<ffi::F32> w2, ffi::Buffer<ffi::F32> b2, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lim, ffi::Buffer<ffi::F32> k2,
                           ffi::Buffer<ffi::F32> v2, ffi::Buffer<ffi::S32> n2, ffi::ResultBuffer<ffi::F32> y,
                           ffi::ResultBuffer<ffi::F32> knew, ffi::ResultBuffer<ffi::F32> vnew, float eps,
                           int32_t schedule, int32_t write) {
  auto bad = [](const char* what) { return ffi::Error::InvalidArgument(what); };
  auto xd = x.dimensions(), kd = k.dimensions(), k2d = k2.dimensions(), ld = lim.dimensions();
  if (xd.size() != 2 || kd.size() != 4 || k2d.size() != 3 || ld.size() != 2)
    return bad("decode_layer: expected x [R, d], k [B, H, C, hd], k2 [B*H, L, hd], lim [B, S]");
  const int64_t d = xd[1], B = kd[0], H = kd[1], C = kd[2], D = kd[3], S = ld[1];
  if (ld[0] != B || xd[0] != B * S || H * D != d || d % 16) return bad("decode_layer: shapes do not agree");
  if (k2d[0] != B * H || k2d[2] != D || v.element_count() != k.element_count() ||
      v2.element_count() != k2.element_count() || n2.element_count() != B * S)
    return bad("decode_layer: cache shapes do not agree");
  auto n = [](const ffi::Buffer<ffi::F32>& buf) { return static_cast<int64_t>(buf.element_count()); };
  const int64_t sizes[][2] = {{n(g1), d}, {n(be1), d}, {n(g2), d}, {n(be2), d}, {n(wqkv), 3 * d * d},
                              {n(bqkv), 3 * d}, {n(wo), d * d}, {n(bo), d}, {n(w1), 4 * d * d},
                              {n(b1), 4 * d}, {n(w2), 4 * d * d}, {n(b2), d}};
  for (auto& s : sizes)
    if (s[0] != s[1]) return bad("decode_layer: a weight does not match the width d");
  const int64_t R = B * S;
  // write 1 (2): knew and vnew are k and v (k2 and v2), aliased, and the new positions go there
  const int64_t out_n = write == 1 ? n(k) : write == 2 ? n(k2) : R * d;
  if (write < 0 || write > 2 || knew->element_count() != out_n || vnew->element_count() != out_n)
    return bad("decode_layer: the outputs for the new keys and values do not match `write`");
  if ((write == 1 && S > C) || (write == 2 && S > k2d[1]))
    return bad("decode_layer: more new positions than the cache they are written to holds");
  // with aliasing the outputs are the inputs; read the keys there in case XLA copied them
  const float* kc = write == 1 ? knew->typed_data() : k.typed_data();
  const float* vc = write == 1 ? vnew->typed_data() : v.typed_data();
  const float* kb = write == 2 ? knew->typed_data() : k2.typed_data();
  const float* vb = write == 2 ? vnew->typed_data() : v2.typed_data();
  thread_local std::vector<float> scratch;
  scratch.resize(R * 10 * d);
  float* s = scratch.data();
  LayerProblem p{x.typed_data(), g1.typed_data(), be1.typed_data(), wqkv.typed_data(), bqkv.typed_data(),
                 wo.typed_data(), bo.typed_data(), g2.typed_data(), be2.typed_data(), w1.typed_data(),
                 b1.typed_data(), w2.typed_data(), b2.typed_data(), kc, vc, kb, vb, lim.typed_data(),
                 n2.typed_data(), y->typed_data(), knew->typed_data(), vnew->typed_data(), s, s + R * d,
                 s + 4 * R * d, s + 5 * R * d, s + 6 * R * d, B, S, H, D, d, C, k2d[1],
                 1.f / std::sqrt(static_cast<float>(D)), eps, write};
  // More threads pay off once a layer's weights are a few hundred kilobytes. Every phase ends in
  // a wait for the slowest thread, so a few threads only (measured on two cores; a few rows give
  // little work per phase).
  const int64_t threads =
      12 * d * d >= (int64_t{1} << 17) ? std::clamp<int64_t>(pool.num_threads(), 1, 4) : 1;
  const LayerPhases phases{p, 2 * threads};
  // schedule: 0 = chosen here, 1 = phases, 2 = pipeline (the last two for tests and benchmarks).
  // The pipeline's blocks are about 16 rows, whole rows of the batch, at least one: it needs
  // several blocks per thread (a prefill of one 64-position prompt is one block, which one
  // thread would run alone).
  const int64_t per = std::max<int64_t>(1, kPipelineBlock / S) * S;
  if (schedule == 2 ||
      (schedule == 0 && threads >= 2 && R >= kPipelineRows && (R + per - 1) / per >= 2 * threads)) {
    RunPipeline(pool, threads, LayerPipeline{p, phases, per});
  } else {
    RunPhases(pool, threads, phases);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdecodePackedDense, PackedDenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // wp
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdecodeDense, DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdecodeDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lim
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k2
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v2
                                  .Arg<ffi::Buffer<ffi::S32>>()  // n2
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdecodeDecodeLayer, DecodeLayerImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ln1 scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ln1 bias
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv kernel, packed
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv bias
                                  .Arg<ffi::Buffer<ffi::F32>>()  // proj kernel, packed
                                  .Arg<ffi::Buffer<ffi::F32>>()  // proj bias
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ln2 scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ln2 bias
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ff1 kernel, packed
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ff1 bias
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ff2 kernel, packed
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ff2 bias
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lim
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k2
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v2
                                  .Arg<ffi::Buffer<ffi::S32>>()  // n2
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new keys
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new values
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("schedule")
                                  .Attr<int32_t>("write"));
