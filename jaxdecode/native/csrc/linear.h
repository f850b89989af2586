// The packed product y = x @ W of the Hugging Face decoder's linear layers (linear.cc) and of its
// fused layer (hf_layer.cc): W kept in the dtype it is stored in (float32, bfloat16, float16, or
// int8 with a float32 scale per output column) and widened to float32 as it is read.
//
// W is packed in panels of 16 columns, wp [N / 16, K, 16] (kernels.pack). A caller gives each
// thread a range of panels (Panels); for each panel every tile of rows of x runs before the next
// panel, so a panel (K * 16 elements: 36 KB of float32 at K = 576) is read from memory once per
// call and from L1/L2 by the later tiles, and batch 8 reads the weights once per step, as batch 1
// does. A tile of up to 8 rows (2 without AVX-512's 32 registers) keeps its 16 columns of y in
// registers, as two partial sums (even and odd k) that hide the multiply-add latency. A row is
// summed in the same order whatever its tile, so its result never depends on how many other rows
// share the call.
//
// The first tile of a panel asks for the next panel (into L2) as it streams this one, so that its
// multiply-adds overlap the next reads. A panel in a stored dtype that more than one tile reads
// (a prompt) is widened once, into a float32 buffer of the thread, not once per tile.
//
// int8: y = (x @ Q) * s, with W = Q * s per column (the scale is applied once, after the sum).
// Everything here is static: each source file that includes it gets its own copy.

#ifndef JAXDECODE_CSRC_LINEAR_H_
#define JAXDECODE_CSRC_LINEAR_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace jaxdecode {

struct F16 {  // tag: IEEE half precision stored as uint16_t
  uint16_t bits;
};

// Sixteen floats: one panel row, one AVX-512 register (two AVX ones elsewhere).
typedef float v16 __attribute__((vector_size(64)));

static inline v16 Load16(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

// All sixteen lanes equal to a: one broadcast, which the multiply-add takes from memory (`v16{} + a`
// would add a to zero first, then broadcast from a register, on the multiply-add's ports).
static inline v16 Splat16(float a) { return v16{a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; }

static inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while (!(m & 0x400));
    bits = sign | ((112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The sixteen weights at p as float32 (exact for every stored dtype).
static inline v16 Widen(const float* p) { return Load16(p); }

static inline v16 Widen(const uint16_t* p) {  // bfloat16: the high half of a float32
#if defined(__AVX512F__)
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
  v16 r;
  std::memcpy(&r, &w, sizeof r);
  return r;
#else
  uint32_t w[16];
  for (int i = 0; i < 16; ++i) w[i] = uint32_t(p[i]) << 16;
  v16 r;
  std::memcpy(&r, w, sizeof r);
  return r;
#endif
}

static inline v16 Widen(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  v16 r;
  std::memcpy(&r, &f, sizeof r);
  return r;
#else
  v16 r;
  for (int i = 0; i < 16; ++i) r[i] = float(p[i]);
  return r;
#endif
}

static inline v16 Widen(const F16* p) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
  v16 r;
  std::memcpy(&r, &f, sizeof r);
  return r;
#else
  v16 r;
  for (int i = 0; i < 16; ++i) r[i] = HalfToFloat(p[i].bits);
  return r;
#endif
}

static inline void InRegister16(v16& x) {
#if defined(__AVX512F__)
  asm("" : "+v"(x));
#else
  (void)x;
#endif
}

// acc[r] (the panel's 16 columns) = x[r, :K] . panel, as two partial sums (even and odd k) added
// at the end: the same order for every row whatever R. With `ahead`, the panel's bytes are asked
// for a few hundred ahead of their use (the first tile of a panel streams it from memory; the
// later ones find it in L1).
template <typename T, int R>
static inline void TileRows(const float* x, int64_t K, const T* panel, const T* next, v16 (&acc)[R]) {
  constexpr int64_t kLine = 64 / (16 * int64_t(sizeof(T))) > 0 ? 64 / (16 * sizeof(T)) : 1;  // k per line
  v16 a0[R] = {}, a1[R] = {};
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
#ifndef JAXDECODE_NO_PREFETCH
    if (next && k % kLine == 0) __builtin_prefetch(next + 16 * k, 0, 2);
#endif
    v16 w0 = Widen(panel + 16 * k), w1 = Widen(panel + 16 * (k + 1));
    InRegister16(w0), InRegister16(w1);
    for (int r = 0; r < R; ++r) {
      a0[r] += Splat16(x[r * K + k]) * w0;
      a1[r] += Splat16(x[r * K + k + 1]) * w1;
    }
  }
  if (k < K) {
    const v16 w0 = Widen(panel + 16 * k);
    for (int r = 0; r < R; ++r) a0[r] += Splat16(x[r * K + k]) * w0;
  }
  for (int r = 0; r < R; ++r) acc[r] = a0[r] + a1[r];
}

template <typename T, int R>
static inline void Tile(const float* x, int64_t K, const T* panel, const T* next, const float* scale, float* y,
                        int64_t N, int64_t n) {
  v16 acc[R];
  TileRows<T, R>(x, K, panel, next, acc);
  for (int r = 0; r < R; ++r) {
    v16 o = acc[r];
    if (scale) o *= Load16(scale + n);
    std::memcpy(y + r * N + n, &o, sizeof o);
  }
}

// TileRows for one or two rows over kStreams panels at once, each from its own stretch of the
// weights: a core keeps more reads in flight over several streams than over one, and the panels'
// sums are independent chains of multiply-adds. Each column is summed exactly as TileRows sums it.
constexpr int kStreams = 4;

template <typename T, int R>
static inline void StreamTile(const float* x, int64_t K, const T* const (&panels)[kStreams], const float* scale,
                              float* y, int64_t N, const int64_t (&ns)[kStreams]) {
  v16 a0[kStreams][R] = {}, a1[kStreams][R] = {};
  int64_t k = 0;
  for (; k + 2 <= K; k += 2)
    for (int s = 0; s < kStreams; ++s) {
      v16 w0 = Widen(panels[s] + 16 * k), w1 = Widen(panels[s] + 16 * (k + 1));
      InRegister16(w0), InRegister16(w1);
      for (int r = 0; r < R; ++r) {
        a0[s][r] += Splat16(x[r * K + k]) * w0;
        a1[s][r] += Splat16(x[r * K + k + 1]) * w1;
      }
    }
  if (k < K)
    for (int s = 0; s < kStreams; ++s) {
      const v16 w0 = Widen(panels[s] + 16 * k);
      for (int r = 0; r < R; ++r) a0[s][r] += Splat16(x[r * K + k]) * w0;
    }
  for (int s = 0; s < kStreams; ++s)
    for (int r = 0; r < R; ++r) {
      v16 o = a0[s][r] + a1[s][r];
      if (scale) o *= Load16(scale + ns[s]);
      std::memcpy(y + r * N + ns[s], &o, sizeof o);
    }
}

#if defined(__AVX512F__)
constexpr int kTile = 8;  // 2 x 8 accumulators, the weights and a broadcast: 19 of 32 registers
#else
constexpr int kTile = 2;
#endif

// The panel at `panel` (columns n..n+16 of y) through every tile of rows; the first tile asks for
// `next` (the next panel, or null) as it streams this one.
template <typename T>
static void PanelRows(const float* x, int64_t M, int64_t K, const T* panel, const T* next, const float* scale,
                      float* y, int64_t N, int64_t n) {
  int64_t r = 0;
  for (; r + kTile <= M; r += kTile) Tile<T, kTile>(x + r * K, K, panel, r == 0 ? next : nullptr, scale, y + r * N, N, n);
  const T* ahead = r == 0 ? next : nullptr;
  switch (M - r) {
    case 7: Tile<T, 7>(x + r * K, K, panel, ahead, scale, y + r * N, N, n); break;
    case 6: Tile<T, 6>(x + r * K, K, panel, ahead, scale, y + r * N, N, n); break;
    case 5: Tile<T, 5>(x + r * K, K, panel, ahead, scale, y + r * N, N, n); break;
    case 4: Tile<T, 4>(x + r * K, K, panel, ahead, scale, y + r * N, N, n); break;
    case 3: Tile<T, 3>(x + r * K, K, panel, ahead, scale, y + r * N, N, n); break;
    case 2: Tile<T, 2>(x + r * K, K, panel, ahead, scale, y + r * N, N, n); break;
    case 1: Tile<T, 1>(x + r * K, K, panel, ahead, scale, y + r * N, N, n); break;
  }
}

// Panel p through every tile of rows (`more`: a next panel follows in this range). A stored dtype
// other than float32 read by more than one tile is widened once, into this thread's buffer (it
// stays in L1/L2), and the tiles read float32: widening is exact and the order of each sum is the
// same, so the result is bit for bit the same as widening in every tile.
template <typename T>
static void OnePanel(const float* x, int64_t M, int64_t K, const T* wp, const float* scale, float* y, int64_t N,
                     int64_t p, bool more) {
  const T* panel = wp + p * K * 16;
  const T* next = more ? panel + K * 16 : nullptr;
  if constexpr (!std::is_same<T, float>::value) {
    if (M > kTile) {
      thread_local std::vector<float> wide;
      if (int64_t(wide.size()) < 16 * K) wide.resize(16 * K);
      constexpr int64_t kLine = 64 / (16 * int64_t(sizeof(T))) > 0 ? 64 / (16 * sizeof(T)) : 1;
      for (int64_t k = 0; k < K; ++k) {
        if (next && k % kLine == 0) __builtin_prefetch(next + 16 * k, 0, 2);
        const v16 w = Widen(panel + 16 * k);
        std::memcpy(wide.data() + 16 * k, &w, sizeof w);
      }
      PanelRows<float>(x, M, K, wide.data(), nullptr, scale, y, N, 16 * p);
      return;
    }
  }
  PanelRows<T>(x, M, K, panel, next, scale, y, N, 16 * p);
}

// y[:, panels p0..p1) for M rows: each panel through every tile of rows before the next panel;
// with one or two rows, kStreams panels at a time from kStreams stretches of the range.
template <typename T>
static void Panels(const float* x, int64_t M, int64_t K, const T* wp, const float* scale, float* y, int64_t N,
                   int64_t p0, int64_t p1) {
  if (M <= 2 && p1 - p0 >= kStreams) {
    const int64_t len = (p1 - p0) / kStreams;  // whole stretches; the rest one panel at a time
    for (int64_t j = 0; j < len; ++j) {
      const T* panels[kStreams];
      int64_t ns[kStreams];
      for (int s = 0; s < kStreams; ++s) {
        const int64_t p = p0 + s * len + j;
        panels[s] = wp + p * K * 16, ns[s] = 16 * p;
      }
      if (M == 1) StreamTile<T, 1>(x, K, panels, scale, y, N, ns);
      else StreamTile<T, 2>(x, K, panels, scale, y, N, ns);
    }
    for (int64_t p = p0 + kStreams * len; p < p1; ++p) OnePanel<T>(x, M, K, wp, scale, y, N, p, p + 1 < p1);
    return;
  }
  for (int64_t p = p0; p < p1; ++p) OnePanel<T>(x, M, K, wp, scale, y, N, p, p + 1 < p1);
}

}  // namespace jaxdecode

#endif  // JAXDECODE_CSRC_LINEAR_H_
