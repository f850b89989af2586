// The packed product y = x @ W (linear.h) for int4 weights: W = (U - 8) * s, U in 0..15, with one
// float16 scale s per column for each group of 32 weights along K (what llama.cpp's Q4_0 holds).
//
// W is packed in panels of 16 columns as linear.h's are, two weights a byte: up [N / 16, K / 2, 16]
// uint8, byte (p, j, c) holding U[2j, 16p + c] in its low four bits and U[2j + 1, 16p + c] in its
// high four; the scales as sp [N / 16, K / 32, 16] float16, each panel's scales in one run
// (kernels.pack4). A panel's 16 columns of 32 weights are 256 bytes and 32 of scales: 4.5 bits a
// weight.
//
// Each pair of weights k, k + 1 is widened as it is read (the nibbles to float32, less 8) and summed
// as linear.h sums a panel, even k into one partial sum and odd k into the other; each group's sum
// is then added to the total times the group's scales (one multiply per group, not per weight).
// Widening a panel into a float32 buffer first (as a prompt's tiles do) gives the same values, so a
// row's result is bit for bit the same whatever rows share its call.

#ifndef JAXDECODE_CSRC_LINEAR4_H_
#define JAXDECODE_CSRC_LINEAR4_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "linear.h"

namespace jaxdecode {

struct Q4 {  // tag: two int4 weights of one column (k even: the low four bits; k odd: the high four)
  uint8_t bits;
};

constexpr int64_t kGroup4 = 32;  // weights along K sharing one scale

// Weights k and k + 1 (k even) of a panel's 16 columns as u - 8 (exact small integers in float32),
// from the 16 bytes at p: the scale is applied per group, after the group's sum.
static inline void Widen4(const Q4* p, v16& w0, v16& w1) {
#if defined(__AVX512F__)
  // u - 8 looked up in a register of the sixteen values (the permute reads an index's low four bits)
  const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m512 lo = _mm512_permutexvar_ps(b, table);
  const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
  std::memcpy(&w0, &lo, sizeof w0);
  std::memcpy(&w1, &hi, sizeof w1);
#else
  for (int i = 0; i < 16; ++i) {
    w0[i] = float(int(p[i].bits & 15) - 8);
    w1[i] = float(int(p[i].bits >> 4) - 8);
  }
#endif
}

// Where a tile reads a panel's pairs of weights: the nibbles themselves, or a float32 copy of
// their u - 8 (a prompt's tiles share one widening). Both give the same values.
struct Nibbles {
  const Q4* panel;
  void Pair(int64_t b, v16& w0, v16& w1) const { Widen4(panel + 16 * b, w0, w1); }
};
struct Widened {
  const float* wide;  // [K, 16]
  void Pair(int64_t b, v16& w0, v16& w1) const { w0 = Load16(wide + 32 * b), w1 = Load16(wide + 32 * b + 16); }
};

// acc[r] = x[r, :K] . panel for R rows: per group of 32, the sums of x times u - 8 (even k and odd
// k apart, as linear.h sums), then added to the total times the group's scales. The same order for
// every row whatever R, and for either source; `next` (and its scales) asked for as this one streams.
template <int R, typename Source>
static inline void TileRows4(const float* x, int64_t K, Source src, const F16* scales, const Q4* next,
                             const F16* next_scales, v16 (&acc)[R]) {
  v16 total[R] = {};
  for (int64_t g = 0; g < K / kGroup4; ++g) {
#ifndef JAXDECODE_NO_PREFETCH
    if (next && g % 2 == 0) __builtin_prefetch(next_scales + 16 * g, 0, 2);
#endif
    v16 a0[R] = {}, a1[R] = {};
    for (int64_t j = 0; j < kGroup4 / 2; ++j) {
      const int64_t b = g * kGroup4 / 2 + j, k = 2 * b;
#ifndef JAXDECODE_NO_PREFETCH
      if (next && j % 4 == 0) __builtin_prefetch(next + 16 * b, 0, 2);
#endif
      v16 w0, w1;
      src.Pair(b, w0, w1);
      InRegister16(w0), InRegister16(w1);
      for (int r = 0; r < R; ++r) {
        a0[r] += Splat16(x[r * K + k]) * w0;
        a1[r] += Splat16(x[r * K + k + 1]) * w1;
      }
    }
    const v16 sv = Widen(scales + 16 * g);
    for (int r = 0; r < R; ++r) total[r] += (a0[r] + a1[r]) * sv;
  }
  for (int r = 0; r < R; ++r) acc[r] = total[r];
}

template <int R, typename Source>
static inline void Tile4(const float* x, int64_t K, Source src, const F16* scales, const Q4* next,
                         const F16* next_scales, float* y, int64_t N, int64_t n) {
  v16 acc[R];
  TileRows4<R>(x, K, src, scales, next, next_scales, acc);
  for (int r = 0; r < R; ++r) std::memcpy(y + r * N + n, &acc[r], sizeof acc[r]);
}

// TileRows4 for one or two rows over kStreams panels at once (linear.h's StreamTile), each column
// summed exactly as TileRows4 sums it.
template <int R>
static inline void StreamTile4(const float* x, int64_t K, const Q4* const (&panels)[kStreams],
                               const F16* const (&scales)[kStreams], float* y, int64_t N,
                               const int64_t (&ns)[kStreams]) {
  v16 total[kStreams][R] = {};
  for (int64_t g = 0; g < K / kGroup4; ++g) {
    v16 a0[kStreams][R] = {}, a1[kStreams][R] = {};
    for (int64_t j = 0; j < kGroup4 / 2; ++j) {
      const int64_t b = g * kGroup4 / 2 + j, k = 2 * b;
      for (int s = 0; s < kStreams; ++s) {
        v16 w0, w1;
        Widen4(panels[s] + 16 * b, w0, w1);
        InRegister16(w0), InRegister16(w1);
        for (int r = 0; r < R; ++r) {
          a0[s][r] += Splat16(x[r * K + k]) * w0;
          a1[s][r] += Splat16(x[r * K + k + 1]) * w1;
        }
      }
    }
    for (int s = 0; s < kStreams; ++s) {
      const v16 sv = Widen(scales[s] + 16 * g);
      for (int r = 0; r < R; ++r) total[s][r] += (a0[s][r] + a1[s][r]) * sv;
    }
  }
  for (int s = 0; s < kStreams; ++s)
    for (int r = 0; r < R; ++r) std::memcpy(y + r * N + ns[s], &total[s][r], sizeof total[s][r]);
}

// The tiles of M rows over one panel's source, `next` asked for by the first.
template <typename Source>
static void TilesOf4(const float* x, int64_t M, int64_t K, Source src, const F16* scales, const Q4* next,
                     const F16* next_scales, float* y, int64_t N, int64_t n) {
  int64_t r = 0;
  for (; r + kTile <= M; r += kTile)
    Tile4<kTile>(x + r * K, K, src, scales, r == 0 ? next : nullptr, next_scales, y + r * N, N, n);
  const Q4* ahead = r == 0 ? next : nullptr;
  switch (M - r) {
#if defined(__AVX512F__)
    case 7: Tile4<7>(x + r * K, K, src, scales, ahead, next_scales, y + r * N, N, n); break;
    case 6: Tile4<6>(x + r * K, K, src, scales, ahead, next_scales, y + r * N, N, n); break;
    case 5: Tile4<5>(x + r * K, K, src, scales, ahead, next_scales, y + r * N, N, n); break;
    case 4: Tile4<4>(x + r * K, K, src, scales, ahead, next_scales, y + r * N, N, n); break;
    case 3: Tile4<3>(x + r * K, K, src, scales, ahead, next_scales, y + r * N, N, n); break;
    case 2: Tile4<2>(x + r * K, K, src, scales, ahead, next_scales, y + r * N, N, n); break;
#endif
    case 1: Tile4<1>(x + r * K, K, src, scales, ahead, next_scales, y + r * N, N, n); break;
    default: break;
  }
}

// Panel p (columns 16p..16p+16 of y) through every tile of rows; more than one tile: its u - 8
// widened once into this thread's buffer, which every tile reads.
static void OnePanel4(const float* x, int64_t M, int64_t K, const Q4* wp, const F16* sp, float* y, int64_t N,
                      int64_t p, bool more) {
  const Q4* panel = wp + p * K * 8;
  const F16* scales = sp + p * (K / kGroup4) * 16;
  const Q4* next = more ? panel + K * 8 : nullptr;
  const F16* next_scales = more ? scales + (K / kGroup4) * 16 : nullptr;
  if (M > kTile) {
    thread_local std::vector<float> wide;
    if (int64_t(wide.size()) < 16 * K) wide.resize(16 * K);
    for (int64_t b = 0; b < K / 2; ++b) {
      v16 w0, w1;
      Widen4(panel + 16 * b, w0, w1);
      std::memcpy(wide.data() + 32 * b, &w0, sizeof w0);
      std::memcpy(wide.data() + 32 * b + 16, &w1, sizeof w1);
    }
    TilesOf4(x, M, K, Widened{wide.data()}, scales, nullptr, nullptr, y, N, 16 * p);
    return;
  }
  TilesOf4(x, M, K, Nibbles{panel}, scales, next, next_scales, y, N, 16 * p);
}

// y[:, panels p0..p1) for M rows (linear.h's Panels): with one or two rows, kStreams panels at a
// time from kStreams stretches of the range.
static void Panels4(const float* x, int64_t M, int64_t K, const Q4* wp, const F16* sp, float* y, int64_t N,
                    int64_t p0, int64_t p1) {
  if (M <= 2 && p1 - p0 >= kStreams) {
    const int64_t len = (p1 - p0) / kStreams;
    for (int64_t j = 0; j < len; ++j) {
      const Q4* panels[kStreams];
      const F16* scales[kStreams];
      int64_t ns[kStreams];
      for (int s = 0; s < kStreams; ++s) {
        const int64_t p = p0 + s * len + j;
        panels[s] = wp + p * K * 8, scales[s] = sp + p * (K / kGroup4) * 16, ns[s] = 16 * p;
      }
      if (M == 1) StreamTile4<1>(x, K, panels, scales, y, N, ns);
      else StreamTile4<2>(x, K, panels, scales, y, N, ns);
    }
    for (int64_t p = p0 + kStreams * len; p < p1; ++p) OnePanel4(x, M, K, wp, sp, y, N, p, p + 1 < p1);
    return;
  }
  for (int64_t p = p0; p < p1; ++p) OnePanel4(x, M, K, wp, sp, y, N, p, p + 1 < p1);
}

}  // namespace jaxdecode

#endif  // JAXDECODE_CSRC_LINEAR4_H_
