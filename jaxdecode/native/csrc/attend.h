// Softmax attention of one query over a few segments of keys and values read in place (the main
// cache, the chunk buffer, a row's new positions) and its building blocks: the kernels of both the
// decode attention operation (attention.cc) and the fused decoder layer (layer.cc, which adds
// variants for several queries at once). Everything here is static: each source file that includes
// it gets its own copy, which the compiler inlines and specializes into that file's loops.

#ifndef JAXDECODE_CSRC_ATTEND_H_
#define JAXDECODE_CSRC_ATTEND_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace jaxdecode {

// Head sizes that are a multiple of 8 take the vector path: eight-float vectors (common.h), four
// keys at a time so that the multiply-adds do not wait on each other.

// Sum of each of four vectors, added in exactly Sum's order (so bit for bit the same), but
// transposed: eight shuffles and adds for the four instead of about six for each.
typedef float v4 __attribute__((vector_size(16)));
static inline v4 Sum4(v8 a, v8 b, v8 c, v8 d) {
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
static inline v4 Max4(v4 m, v4 x) { return m < x ? x : m; }
static inline float Max(v4 m) { return std::max(std::max(m[0], m[1]), std::max(m[2], m[3])); }

typedef int v8i __attribute__((vector_size(32)));

// exp for x <= 0 (scores minus their maximum), Cephes' single-precision method: 2^n times a
// degree-6 polynomial on [-ln2/2, ln2/2]; within 2 ulp of std::exp down to about 1e-38.
static inline v8 Exp(v8 x) {
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
static inline float ExpShift(float* scores, int64_t n, float mx) {
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

// out[t] = q . key t for the n keys at kb (q given scaled, as vectors qv); raises mx to their
// maximum.
template <int NV>
static void Scores(const v8* qv, const float* kb, int64_t n, float* out, float& mx) {
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

// acc += w[t] * value t over the n values at vb.
template <int NV>
static void Weighted(const float* w, const float* vb, int64_t n, v8* acc) {
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
static void AttendVec(const float* q, float scale, const Segment* segs, int nseg, float* out,
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

static void AttendScalar(const float* q, int64_t D, float scale, const Segment* segs, int nseg,
                         float* out, std::vector<float>& scores) {
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

static void Attend(const float* q, int64_t D, float scale, const Segment* segs, int nseg, float* out,
                   std::vector<float>& scores) {
  switch (D) {
    case 16: return AttendVec<2>(q, scale, segs, nseg, out, scores);
    case 32: return AttendVec<4>(q, scale, segs, nseg, out, scores);
    case 64: return AttendVec<8>(q, scale, segs, nseg, out, scores);
    case 128: return AttendVec<16>(q, scale, segs, nseg, out, scores);
    default: return AttendScalar(q, D, scale, segs, nseg, out, scores);
  }
}

}  // namespace jaxdecode

#endif  // JAXDECODE_CSRC_ATTEND_H_
