// A whole Hugging Face decoder layer of the Llama kind as one call: FFI handler JaxdecodeHFLayer.
//
//   h = rms(x) * n1;  q, k, v = split(h @ Wqkv + bqkv);  q, k = rms per head (optional), rotated
//   k, v written into the cache at each row's position;  x1 = x + attend(q, cache) @ Wo (over a
//   sliding window, if the layer has one)
//   y = x1 + (silu(g) * u) @ Wdown,  with g, u = split(rms(x1) * n2 @ Wgu)
//
// A decode step at a small batch is bound by reading the weights. Called product by product, a
// layer is four native products with XLA's own operations between them (norms, rotation, the
// cache's writes, the attention call, residuals, the activation: about fifteen operations of a few
// microseconds each), and each product starts its memory streams over. Here the layer is one call
// whose phases (below) run on the calling thread and one more, which claim work items phase by
// phase and wait for each other only between phases (threads.h).
//
// The four matrices are packed in panels of 16 columns in one dtype (float32, bfloat16, float16,
// int8 with a float32 scale per column, or int4 in groups of 32 with float16 scales), and go through
// linear.h's product (linear4.h's for int4), so every product is
// summed exactly as the separate native product sums it. Inputs: x [R, d] (R = B * S, row b's S
// new positions in order), pos [R] (the position of each: it is written there, and sees the
// cache's positions 0..pos; a row whose positions run past the cache is written at its end, as
// dynamic_update_slice writes, and sees all of it), cos and sin [R, D / 2] of the rotation at those
// positions, the cache k, v [B, KV, C, D] (written in place: aliased to the outputs). The model's portable layer
// (models/hf/transformer.py) is the reference the tests hold this to.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "attend.h"
#include "common.h"
#include "linear.h"
#include "linear4.h"
#include "threads.h"

namespace jaxdecode {
namespace {

// out = x / sqrt(mean(x^2) + eps) * w over n values (w null: no scale).
void RmsNorm(const float* x, const float* w, float eps, int64_t n, float* out) {
  v8 acc = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 a = Load(x + i);
    acc += a * a;
  }
  float ss = Sum(acc);
  for (; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / n + eps);
  for (i = 0; i < n; ++i) out[i] = w ? x[i] * inv * w[i] : x[i] * inv;
}

// Rotate-half rotation of one head of D values in place: cos, sin [D / 2].
void Rotate(float* h, int64_t D, const float* cs, const float* sn) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = h[i], b = h[i + half];
    h[i] = a * cs[i] - b * sn[i];
    h[i + half] = b * cs[i] + a * sn[i];
  }
}

// out = silu(g) * u over n values, silu(g) = g * sigmoid(g) with the exponential taken of -|g| only
// (attend.h's Exp, for arguments <= 0).
void GatedSilu(const float* g, const float* u, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 x = Load(g + j);
    const v8 e = Exp(x < 0 ? x : -x);
    const v8 o = x * (x < 0 ? e / (1.f + e) : 1.f / (1.f + e)) * Load(u + j);
    __builtin_memcpy(out + j, &o, sizeof o);
  }
  for (; j < n; ++j) out[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
}

constexpr int64_t kActChunk = 256;  // the activation's work item: this many values of a row

struct Problem {
  const float *x, *n1, *n2, *bqkv, *qn, *kn, *cs, *sn;  // bqkv, qn, kn: null when absent
  const void *wqkv, *wo, *wgu, *wd;
  const void *sqkv, *so, *sgu, *sd;  // int8 scales (float32), int4 scales (float16), else null
  float *kc, *vc;
  const int32_t* pos;
  float* y;
  float *h, *qkv, *att, *o, *x1, *gu, *mid;  // scratch
  // int4: the products' inputs prepared for linear4.h's integer sums (h, att, mid) as the phases
  // before the products write them; att only when a key/value head's query heads span whole groups
  // of 32 (else its product prepares it)
  Prepared4 *hq, *aq, *mq;
  int64_t R, S, d, H, KV, D, C, F, window, items;  // window: 0 for none; items: ranges of panels per product
  float eps, scale;
};

template <typename T>
struct Phases {
  static constexpr int kPhases = 10;
  Problem p;

  int64_t Items(int phase) const {
    switch (phase) {
      case 1: case 4: case 6: case 8: return p.items;
      case 3: return p.R * p.KV;
      case 7: return p.R * Chunks();
      default: return p.R;
    }
  }

  int64_t Chunks() const { return (p.F + kActChunk - 1) / kActChunk; }

  // Panels [i * per, ...) of the product y [R, N] = x [R, K] @ w, as `items` ranges.
  void Product(const float* x, int64_t K, const void* w, const void* s, float* y, int64_t N,
               int64_t i) const {
    const int64_t panels = N / 16, per = (panels + p.items - 1) / p.items;
    const int64_t p0 = std::min(panels, i * per), p1 = std::min(panels, p0 + per);
    if (p0 >= p1) return;
    if constexpr (std::is_same<T, Q4>::value) {
      const Prepared4* ready = x == p.h ? p.hq : x == p.mid ? p.mq : AttPrepared() ? p.aq : nullptr;
      if (ready)
        PanelsPrepared4(ready->rows.data(), p.R, K, static_cast<const Q4*>(w), static_cast<const F16*>(s), y, N,
                        p0, p1);
      else
        Panels4(x, p.R, K, static_cast<const Q4*>(w), static_cast<const F16*>(s), y, N, p0, p1);
    } else
      Panels<T>(x, p.R, K, static_cast<const T*>(w), static_cast<const float*>(s), y, N, p0, p1);
  }

  static constexpr bool kInt4 = std::is_same<T, Q4>::value;
  bool AttPrepared() const { return (p.H / p.KV * p.D) % kGroup4 == 0; }

  void Run(int phase, int64_t i) const {
    const int64_t d = p.d, D = p.D, Q = p.H * D, N = Q + 2 * p.KV * D;
    switch (phase) {
      case 0:
        RmsNorm(p.x + i * d, p.n1, p.eps, d, p.h + i * d);
        if constexpr (kInt4) p.hq->Fill(i, d, p.h + i * d, 0, d);
        return;
      case 1: return Product(p.h, d, p.wqkv, p.sqkv, p.qkv, N, i);
      case 2: return Prepare(i);
      case 3:
        Attention(i / p.KV, i % p.KV);
        if constexpr (kInt4) {
          const int64_t r = i / p.KV, span = p.H / p.KV * D, at = i % p.KV * span;
          if (AttPrepared()) p.aq->Fill(r, Q, p.att + r * Q + at, at, span);
        }
        return;
      case 4: return Product(p.att, Q, p.wo, p.so, p.o, d, i);
      case 5: {
        float* x1 = p.x1 + i * d;
        for (int64_t j = 0; j < d; ++j) x1[j] = p.x[i * d + j] + p.o[i * d + j];
        RmsNorm(x1, p.n2, p.eps, d, p.h + i * d);
        if constexpr (kInt4) p.hq->Fill(i, d, p.h + i * d, 0, d);
        return;
      }
      case 6: return Product(p.h, d, p.wgu, p.sgu, p.gu, 2 * p.F, i);
      case 7: {
        const int64_t r = i / Chunks(), j = i % Chunks() * kActChunk;
        const float* g = p.gu + r * 2 * p.F + j;
        GatedSilu(g, g + p.F, std::min(kActChunk, p.F - j), p.mid + r * p.F + j);
        if constexpr (kInt4) p.mq->Fill(r, p.F, p.mid + r * p.F + j, j, std::min(kActChunk, p.F - j));
        return;
      }
      case 8: return Product(p.mid, p.F, p.wd, p.sd, p.o, d, i);
      default:
        for (int64_t j = 0; j < d; ++j) p.y[i * d + j] = p.x1[i * d + j] + p.o[i * d + j];
    }
  }

  // Row r's q, k, v: bias, per-head norms, rotation; its key and value written into the cache.
  void Prepare(int64_t r) const {
    const int64_t D = p.D, Q = p.H * D, N = Q + 2 * p.KV * D, b = r / p.S;
    // written where dynamic_update_slice would write it: the row's first position, moved back
    // inside the cache if the row's positions do not fit (a finished row still stepping)
    const int64_t at = std::clamp<int64_t>(p.pos[b * p.S], 0, p.C - p.S) + r % p.S;
    float* row = p.qkv + r * N;
    if (p.bqkv)
      for (int64_t j = 0; j < N; ++j) row[j] += p.bqkv[j];
    const float *cs = p.cs + r * (D / 2), *sn = p.sn + r * (D / 2);
    for (int64_t h = 0; h < p.H + p.KV; ++h) {  // the query heads, then the key heads
      float* head = row + h * D;
      if (p.qn) RmsNorm(head, h < p.H ? p.qn : p.kn, p.eps, D, head);
      Rotate(head, D, cs, sn);
    }
    for (int64_t j = 0; j < p.KV; ++j) {
      const int64_t slot = ((b * p.KV + j) * p.C + at) * D;
      std::copy(row + Q + j * D, row + Q + (j + 1) * D, p.kc + slot);
      std::copy(row + Q + (p.KV + j) * D, row + Q + (p.KV + j + 1) * D, p.vc + slot);
    }
  }

  // The query heads of key/value head j at row r over the cache's positions 0..pos[r] (the last
  // `window` of them with a sliding window; all of them past the cache's end).
  void Attention(int64_t r, int64_t j) const {
    thread_local std::vector<float> scores;
    const int64_t D = p.D, G = p.H / p.KV, N = (p.H + 2 * p.KV) * D, b = r / p.S, at = p.pos[r];
    const int64_t hi = std::clamp<int64_t>(at + 1, 1, p.C);
    const int64_t lo = p.window > 0 ? std::clamp<int64_t>(at - p.window + 1, 0, hi - 1) : 0;
    const int64_t base = ((b * p.KV + j) * p.C + lo) * D;
    const Segment seg{p.kc + base, p.vc + base, hi - lo};
    for (int64_t g = 0; g < G; ++g) {
      const int64_t head = j * G + g;
      Attend(p.qkv + r * N + head * D, D, p.scale, &seg, 1, p.att + r * p.H * D + head * D, scores);
    }
  }
};

ffi::Error HFLayerImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> pos,
                       ffi::Buffer<ffi::F32> cs, ffi::Buffer<ffi::F32> sn, ffi::Buffer<ffi::F32> n1,
                       ffi::Buffer<ffi::F32> bqkv, ffi::Buffer<ffi::F32> qn, ffi::Buffer<ffi::F32> kn,
                       ffi::AnyBuffer wqkv, ffi::AnyBuffer sqkv, ffi::AnyBuffer wo,
                       ffi::AnyBuffer so, ffi::Buffer<ffi::F32> n2, ffi::AnyBuffer wgu,
                       ffi::AnyBuffer sgu, ffi::AnyBuffer wd,
                       ffi::AnyBuffer sd, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                       ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> kout,
                       ffi::ResultBuffer<ffi::F32> vout, int64_t S, int64_t heads, int64_t window, float eps,
                       float scale) {
  auto bad = [](const std::string& what) { return ffi::Error::InvalidArgument("hf_layer: " + what); };
  auto xd = x.dimensions(), kd = k.dimensions();
  if (xd.size() != 2 || kd.size() != 4) return bad("expected x [R, d] and a cache [B, KV, C, D]");
  const int64_t R = xd[0], d = xd[1], B = kd[0], KV = kd[1], C = kd[2], D = kd[3], H = heads;
  if (S < 1 || R != B * S || H % KV || D % 2 || int64_t(pos.element_count()) != R ||
      v.element_count() != k.element_count())
    return bad("the rows, positions and cache do not agree");
  if (int64_t(cs.element_count()) != R * (D / 2) || int64_t(sn.element_count()) != R * (D / 2))
    return bad("cos and sin are not [R, D/2]");
  const int64_t Q = H * D, N = Q + 2 * KV * D;
  const ffi::DataType dt = wqkv.element_type();
  const bool int4 = dt == ffi::DataType::U8;  // two weights a byte (linear4.h)
  auto packed = [int4](const ffi::AnyBuffer& w, int64_t K, int64_t cols) {
    auto wdim = w.dimensions();
    return wdim.size() == 3 && wdim[0] * 16 == cols && (int4 ? 2 * wdim[1] : wdim[1]) == K && wdim[2] == 16 &&
           (!int4 || K % kGroup4 == 0);
  };
  if (!packed(wqkv, d, N) || !packed(wo, Q, d) || wgu.dimensions().size() != 3)
    return bad("a matrix is not packed to the layer's shape");
  const int64_t F = wgu.dimensions()[0] * 8;
  if (!packed(wgu, d, 2 * F) || !packed(wd, F, d))
    return bad("the MLP's matrices are not packed to its shape");
  if (wo.element_type() != dt || wgu.element_type() != dt || wd.element_type() != dt)
    return bad("the four matrices must share one dtype");
  const bool int8 = dt == ffi::DataType::S8;
  // int8: a float32 scale per column; int4: a float16 scale per column and group of 32 (K / 32 * cols)
  auto scale_of = [&](const ffi::AnyBuffer& s, int64_t K, int64_t cols) -> const void* {
    if (int8 && s.element_type() == ffi::DataType::F32 && int64_t(s.element_count()) == cols)
      return s.untyped_data();
    if (int4 && s.element_type() == ffi::DataType::F16 && int64_t(s.element_count()) == K / kGroup4 * cols)
      return s.untyped_data();
    return nullptr;
  };
  const void *s1 = scale_of(sqkv, d, N), *s2 = scale_of(so, Q, d);
  const void *s3 = scale_of(sgu, d, 2 * F), *s4 = scale_of(sd, F, d);
  if (int8 != (s1 && s2 && s3 && s4) && !int4) return bad("int8 matrices need a scale per column, and only they");
  if (int4 && !(s1 && s2 && s3 && s4)) return bad("int4 matrices need a float16 scale per column and group of 32");
  if (n1.element_count() != d || n2.element_count() != d) return bad("a norm's weight is not [d]");
  const bool bias = bqkv.element_count() != 0, norms = qn.element_count() != 0;
  if ((bias && bqkv.element_count() != N) || (norms && (qn.element_count() != D || kn.element_count() != D)))
    return bad("the q/k/v bias is not [N] or a q/k norm is not [D]");
  if (S > C) return bad("more new positions than the cache holds");
  const int32_t* at = pos.typed_data();

  thread_local std::vector<float> scratch;
  scratch.resize(R * (4 * d + N + Q + 3 * F));
  float* s = scratch.data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  Problem p{x.typed_data(), n1.typed_data(), n2.typed_data(), bias ? bqkv.typed_data() : nullptr,
            norms ? qn.typed_data() : nullptr, norms ? kn.typed_data() : nullptr, cs.typed_data(),
            sn.typed_data(),
            wqkv.untyped_data(), wo.untyped_data(), wgu.untyped_data(), wd.untyped_data(), s1, s2, s3, s4,
            kout->typed_data(), vout->typed_data(), at, y->typed_data(),
            s, s + R * d, s + R * (d + N), s + R * (d + N + Q), s + R * (2 * d + N + Q),
            s + R * (3 * d + N + Q), s + R * (3 * d + N + Q + 2 * F),
            nullptr, nullptr, nullptr,
            R, S, d, H, KV, D, C, F, std::max<int64_t>(window, 0), threads > 1 ? 2 * threads : 1, eps, scale};
  if (int4) {
    thread_local Prepared4 hq, aq, mq;
    hq.Resize(R, d), aq.Resize(R, Q), mq.Resize(R, F);
    p.hq = &hq, p.aq = &aq, p.mq = &mq;
  }
  switch (dt) {
    case ffi::DataType::F32: RunPhases(pool, threads, Phases<float>{p}); break;
    case ffi::DataType::BF16: RunPhases(pool, threads, Phases<uint16_t>{p}); break;
    case ffi::DataType::F16: RunPhases(pool, threads, Phases<F16>{p}); break;
    case ffi::DataType::S8: RunPhases(pool, threads, Phases<int8_t>{p}); break;
    case ffi::DataType::U8: RunPhases(pool, threads, Phases<Q4>{p}); break;
    default: return bad("the matrices must be float32, bfloat16, float16, int8 or int4");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxdecode

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdecodeHFLayer, jaxdecode::HFLayerImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [R, d]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos [R]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [R, D/2]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin [R, D/2]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm 1 [d]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q/k/v bias [N], or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q norm [D], or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k norm [D], or empty
                                  .Arg<ffi::AnyBuffer>()         // Wqkv, packed
                                  .Arg<ffi::AnyBuffer>()         // its scale, or empty
                                  .Arg<ffi::AnyBuffer>()         // Wo, packed
                                  .Arg<ffi::AnyBuffer>()         // its scale, or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm 2 [d]
                                  .Arg<ffi::AnyBuffer>()         // Wgu (gate, then up), packed
                                  .Arg<ffi::AnyBuffer>()         // its scale, or empty
                                  .Arg<ffi::AnyBuffer>()         // Wdown, packed
                                  .Arg<ffi::AnyBuffer>()         // its scale, or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v cache
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [R, d]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k cache, written (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v cache, written (aliased)
                                  .Attr<int64_t>("rows_per_batch")
                                  .Attr<int64_t>("heads")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("eps")
                                  .Attr<float>("scale"));
