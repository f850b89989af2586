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
#include <cmath>
#include <cstdint>
#include <memory>
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

// Generic version: any head size.
void RowHeadScalar(const Problem& p, int64_t bh, std::vector<float>& scores) {
  const int64_t b = bh / p.H, D = p.D;
  const float* kb = p.k + bh * p.C * D;
  const float* vb = p.v + bh * p.C * D;
  const float* k2b = p.k2 + bh * p.L * D;
  const float* v2b = p.v2 + bh * p.L * D;
  for (int64_t s = 0; s < p.S; ++s) {
    const int64_t n1 = std::clamp<int64_t>(p.lim[b * p.S + s], 0, p.C);
    const int64_t m2 = std::clamp<int64_t>(p.n2[b * p.S + s], 0, p.L);
    const float* qs = p.q + (bh * p.S + s) * D;
    float* os = p.out + (bh * p.S + s) * D;
    std::fill(os, os + D, 0.f);
    if (n1 + m2 == 0) continue;
    scores.resize(n1 + m2);
    float mx = -INFINITY;
    for (int64_t t = 0; t < n1 + m2; ++t) {
      const float* kt = t < n1 ? kb + t * D : k2b + (t - n1) * D;
      float acc = 0.f;
      for (int64_t i = 0; i < D; ++i) acc += qs[i] * kt[i];
      scores[t] = p.scale * acc;
      mx = std::max(mx, scores[t]);
    }
    float total = 0.f;
    for (int64_t t = 0; t < n1 + m2; ++t) total += (scores[t] = std::exp(scores[t] - mx));
    const float inv = 1.f / total;
    for (int64_t t = 0; t < n1 + m2; ++t) {
      const float* vt = t < n1 ? vb + t * D : v2b + (t - n1) * D;
      const float w = scores[t] * inv;
      for (int64_t i = 0; i < D; ++i) os[i] += w * vt[i];
    }
  }
}

// Head sizes that are a multiple of 8: eight-float vectors (AVX with -march=native, two SSE
// registers otherwise), four keys at a time so that the multiply-adds do not wait on each other.
typedef float v8 __attribute__((vector_size(32)));

inline v8 Load(const float* p) {
  v8 r;
  __builtin_memcpy(&r, p, sizeof r);
  return r;
}

inline float Sum(v8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

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
  for (; t + 4 <= n; t += 4) {
    const float* k0 = kb + t * D;
    v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int j = 0; j < NV; ++j) {
      a0 += qv[j] * Load(k0 + 8 * j);
      a1 += qv[j] * Load(k0 + D + 8 * j);
      a2 += qv[j] * Load(k0 + 2 * D + 8 * j);
      a3 += qv[j] * Load(k0 + 3 * D + 8 * j);
    }
    out[t] = Sum(a0), out[t + 1] = Sum(a1), out[t + 2] = Sum(a2), out[t + 3] = Sum(a3);
    mx = std::max(mx, std::max(std::max(out[t], out[t + 1]), std::max(out[t + 2], out[t + 3])));
  }
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
    const v8 wt = v8{} + w[t];
    for (int j = 0; j < NV; ++j) acc[j] += wt * Load(vb + t * D + 8 * j);
  }
}

template <int NV>
void RowHeadVec(const Problem& p, int64_t bh, std::vector<float>& scores) {
  constexpr int64_t D = 8 * NV;
  const int64_t b = bh / p.H;
  const float* kb = p.k + bh * p.C * D;
  const float* vb = p.v + bh * p.C * D;
  const float* k2b = p.k2 + bh * p.L * D;
  const float* v2b = p.v2 + bh * p.L * D;
  for (int64_t s = 0; s < p.S; ++s) {
    const int64_t n1 = std::clamp<int64_t>(p.lim[b * p.S + s], 0, p.C);
    const int64_t m2 = std::clamp<int64_t>(p.n2[b * p.S + s], 0, p.L);
    const float* qs = p.q + (bh * p.S + s) * D;
    float* os = p.out + (bh * p.S + s) * D;
    if (n1 + m2 == 0) {
      std::fill(os, os + D, 0.f);
      continue;
    }
    v8 qv[NV];
    for (int j = 0; j < NV; ++j) qv[j] = Load(qs + 8 * j) * p.scale;
    scores.resize(n1 + m2);
    float mx = -INFINITY;
    Scores<NV>(qv, kb, n1, scores.data(), mx);
    Scores<NV>(qv, k2b, m2, scores.data() + n1, mx);
    const float total = ExpShift(scores.data(), n1 + m2, mx);
    v8 acc[NV] = {};
    Weighted<NV>(scores.data(), vb, n1, acc);
    Weighted<NV>(scores.data() + n1, v2b, m2, acc);
    const float inv = 1.f / total;
    for (int j = 0; j < NV; ++j) {
      const v8 o = acc[j] * inv;
      __builtin_memcpy(os + 8 * j, &o, sizeof o);
    }
  }
}

void RowHead(const Problem& p, int64_t bh, std::vector<float>& scores) {
  switch (p.D) {
    case 16: return RowHeadVec<2>(p, bh, scores);
    case 32: return RowHeadVec<4>(p, bh, scores);
    case 64: return RowHeadVec<8>(p, bh, scores);
    case 128: return RowHeadVec<16>(p, bh, scores);
    default: return RowHeadScalar(p, bh, scores);
  }
}

// Runs fn(i) for every i in [0, items) on the calling thread and up to `threads - 1` tasks of
// XLA's intra-op pool. The counters live in a shared_ptr: a task that starts late (even after the
// call returned) finds no item left and touches nothing else, so fn must capture by value.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t items, int64_t threads, F fn) {
  struct Counters {
    std::atomic<int64_t> next{0}, finished{0};
  };
  auto c = std::make_shared<Counters>();
  auto work = [c, items, fn] {
    for (int64_t i; (i = c->next.fetch_add(1)) < items;) {
      fn(i);
      c->finished.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < std::min(threads, items); ++t) pool.Schedule([work] { work(); });
  work();
  while (c->finished.load(std::memory_order_acquire) < items) std::this_thread::yield();
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
        for (int j = 0; j < 8; ++j) xs[j] = v8{} + xr[j];
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
        const v8 xk = v8{} + x[r * K + k];
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
// y = x @ w + b for 3-8 rows, with w packed in panels of 16 columns: wp [N / 16, K, 16] (see
// kernels.pack). A panel is read in order, once, while the R x 16 tile of y stays in registers;
// the arithmetic, not the weights, is then the limit.

template <int R>
void PanelTile(const float* x, int64_t K, const float* panel, const float* b, float* y, int64_t N,
               int64_t n) {
  v8 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = Load(b + n), a1[r] = Load(b + n + 8);
  for (int64_t k = 0; k < K; ++k) {
    const v8 w0 = Load(panel + 16 * k), w1 = Load(panel + 16 * k + 8);
    for (int r = 0; r < R; ++r) {
      const v8 xr = v8{} + x[r * K + k];
      a0[r] += xr * w0, a1[r] += xr * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    __builtin_memcpy(y + r * N + n, &a0[r], sizeof(v8));
    __builtin_memcpy(y + r * N + n + 8, &a1[r], sizeof(v8));
  }
}

struct PackedProblem {
  const float *x, *wp, *b;
  float* y;
  int64_t M, K, N;

  void Panel(int64_t p) const {
    const float* panel = wp + p * K * 16;
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) PanelTile<4>(x + r * K, K, panel, b, y + r * N, N, 16 * p);
    switch (M - r) {
      case 3: PanelTile<3>(x + r * K, K, panel, b, y + r * N, N, 16 * p); break;
      case 2: PanelTile<2>(x + r * K, K, panel, b, y + r * N, N, 16 * p); break;
      case 1: PanelTile<1>(x + r * K, K, panel, b, y + r * N, N, 16 * p); break;
    }
  }

};

ffi::Error PackedDenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                           ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = wp.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != 16 || xd[1] != wd[1] || b.element_count() != 16 * wd[0])
    return ffi::Error::InvalidArgument("packed_dense: expected x [M, K], wp [N/16, K, 16], b [N]");
  const PackedProblem p{x.typed_data(), wp.typed_data(), b.typed_data(), y->typed_data(), xd[0], xd[1],
                        16 * wd[0]};
  const int64_t panels = wd[0];
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), panels));
  const int64_t per = (panels + threads - 1) / threads;  // panels per thread
  const int64_t items = (panels + per - 1) / per;
  ParallelFor(pool, items, items, [p, per, panels](int64_t i) {
    for (int64_t q = i * per; q < std::min(panels, (i + 1) * per); ++q) p.Panel(q);
  });
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
