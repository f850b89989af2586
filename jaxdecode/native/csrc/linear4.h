// The packed product y = x @ W (linear.h) for int4 weights: W = (U - 8) * s, U in 0..15, with one
// float16 scale s per column for each group of 32 weights along K (what llama.cpp's Q4_0 holds),
// summed in integers.
//
// Each row of x is first split, per group of 32 values, into three pieces of signed bytes (Prepare4):
// x = (q1 * 2^14 + q2 * 2^7 + q3) * step, step a power of two chosen from the group's largest |x|
// (|x| / step < 2^21), so that what is dropped is at most one step, 2^-20 of that largest |x|: less
// than float32's own rounding of a product summed over the group. A group's product with a column is
// then exact integer arithmetic, sum over k of U[k] * q_i[k] for each piece (the AVX-512 VNNI
// instruction sums four such byte products a lane), combined as (a1 * 2^14 + a2 * 2^7 + a3) less 8
// times the sum of the row's pieces (the U - 8), and added to the column's float32 total times its
// scale and the row's step (Finish4). Integer sums have no order, so a row's result is bit for bit
// the same whatever rows share its call and however the loops below are arranged.
//
// W is packed in panels of 16 columns, two weights a byte: up [N / 16, K / 2, 16] uint8 holding,
// for each panel and group of 32 along K, four blocks of 64 bytes; block t's bytes 4c..4c+3 belong
// to column c, byte i holding U[32g + 8t + i] in its low four bits and U[32g + 8t + 4 + i] in its
// high four (kernels.pack4), so that a block's low nibbles are four weights of each column for one
// instruction and its high nibbles four more. The scales are sp [N / 16, K / 32, 16] float16, each
// panel's in one run. A panel's 16 columns of 32 weights are 256 bytes and 32 of scales: 4.5 bits
// a weight.

#ifndef JAXDECODE_CSRC_LINEAR4_H_
#define JAXDECODE_CSRC_LINEAR4_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "linear.h"

namespace jaxdecode {

struct Q4 {  // tag: a byte of two int4 weights (kernels.pack4's order)
  uint8_t bits;
};

constexpr int64_t kGroup4 = 32;      // weights along K sharing one scale
constexpr int kPieces4 = 3;          // signed-byte pieces of each value of x
constexpr int64_t kRowGroup4 = 96;   // bytes of one row's group: the three pieces of 32 values
constexpr int64_t kBlock4 = 64;      // bytes of a panel's block: 16 columns of 8 weights
constexpr int64_t kAhead4 = 2048;    // streams: bytes of each panel asked for ahead of their use

typedef int32_t v16i __attribute__((vector_size(64)));

// A row's prepared groups: q [G, 3, 32] pieces, step [G], sum8 [G] (8 times the sum over the
// group of q1 * 2^14 + q2 * 2^7 + q3).
struct Row4 {
  const int8_t* q;
  const float* step;
  const int32_t* sum8;
};

// One group of 32 values as Row4's pieces, step and sum8 (the header says how); plain code, for
// any group (the AVX-512 one below takes the common ones). A group of zeros gets step 0; one holding
// a NaN or an infinity gets step NaN (its products are NaN, as the float product's would be).
static inline void PrepareGroup4(const float* x, int8_t* q, float* step, int32_t* sum8) {
  float m = 0.f;
  bool finite = true;
  for (int64_t k = 0; k < kGroup4; ++k) m = std::max(m, std::fabs(x[k])), finite &= std::isfinite(x[k]);
  if (!finite || m == 0.f) {
    std::memset(q, 0, kRowGroup4);
    *step = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
    *sum8 = 0;
    return;
  }
  int e;
  std::frexp(m, &e);  // m < 2^e
  float r[kGroup4];
  for (int64_t k = 0; k < kGroup4; ++k) r[k] = x[k];
  int32_t total = 0;
  for (int i = 0; i < kPieces4; ++i) {
    // piece i: r * 2^(7 + 7i - e) within -128..128 (the first: |x| < 2^e; later: the residue of
    // the last piece, within one of its steps), rounded to the nearest and held within +-127
    const int shift = 7 + 7 * i - e;
    const float s = std::ldexp(1.f, -shift), inv = std::ldexp(1.f, shift);
    for (int64_t k = 0; k < kGroup4; ++k) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(r[k] * inv)));
      q[i * kGroup4 + k] = int8_t(v);
      total += int32_t(v) * (int32_t{1} << (14 - 7 * i));
      r[k] -= v * s;  // exact: v * s and r share their last bits
    }
  }
  *step = std::ldexp(1.f, e - 21);
  *sum8 = 8 * total;
}

// The G = n / 32 groups of x [n] as Row4's arrays.
static inline void Prepare4(const float* x, int64_t n, int8_t* q, float* step, int32_t* sum8) {
  for (int64_t g = 0; g < n / kGroup4; ++g) {
    const float* xg = x + g * kGroup4;
    int8_t* qg = q + g * kRowGroup4;
#if defined(__AVX512F__)
    const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
    const __m512 big = _mm512_set1_ps(std::numeric_limits<float>::max());
    const __m512 aa = _mm512_abs_ps(a), ab = _mm512_abs_ps(b);
    const bool finite = _mm512_cmp_ps_mask(aa, big, _CMP_LE_OQ) == 0xFFFF &&
                        _mm512_cmp_ps_mask(ab, big, _CMP_LE_OQ) == 0xFFFF;
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(aa, ab));
    uint32_t bits;
    std::memcpy(&bits, &m, sizeof bits);
    const int biased = int(bits >> 23);  // m >= 0: no sign bit
    if (finite && biased >= 40) {  // m = f * 2^e, e = biased - 126; every scale below a normal float
      const int e = biased - 126;
      __m512 ra = a, rb = b;
      __m512i sum = _mm512_setzero_si512();
      for (int i = 0; i < kPieces4; ++i) {
        const int shift = 7 + 7 * i - e;
        const __m512 inv = _mm512_castsi512_ps(_mm512_set1_epi32((127 + shift) << 23));
        const __m512 s = _mm512_castsi512_ps(_mm512_set1_epi32((127 - shift) << 23));
        const __m512 lim = _mm512_set1_ps(127.f), nlim = _mm512_set1_ps(-127.f);
        constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512 va = _mm512_min_ps(lim, _mm512_max_ps(nlim, _mm512_roundscale_ps(_mm512_mul_ps(ra, inv), kNearest)));
        const __m512 vb = _mm512_min_ps(lim, _mm512_max_ps(nlim, _mm512_roundscale_ps(_mm512_mul_ps(rb, inv), kNearest)));
        const __m512i ia = _mm512_cvtps_epi32(va), ib = _mm512_cvtps_epi32(vb);
        _mm_storeu_si128((__m128i*)(qg + i * kGroup4), _mm512_cvtepi32_epi8(ia));
        _mm_storeu_si128((__m128i*)(qg + i * kGroup4 + 16), _mm512_cvtepi32_epi8(ib));
        sum = _mm512_add_epi32(sum, _mm512_slli_epi32(_mm512_add_epi32(ia, ib), 14 - 7 * i));
        ra = _mm512_fnmadd_ps(va, s, ra);  // exact, as above
        rb = _mm512_fnmadd_ps(vb, s, rb);
      }
      step[g] = std::ldexp(1.f, e - 21);
      sum8[g] = 8 * _mm512_reduce_add_epi32(sum);
      continue;
    }
#endif
    PrepareGroup4(xg, qg, step + g, sum8 + g);
  }
}

// Four signed bytes of a row's piece as one int32 (for a broadcast).
static inline int32_t Bytes4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// acc[c] += sum over i < 4 of u[4c + i] * q[i], u unsigned bytes (0..15 here), q signed bytes.
static inline v16i Dot4(v16i acc, v16i u, int32_t q) {
#if defined(__AVX512VNNI__)
  return (v16i)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, _mm512_set1_epi32(q));
#elif defined(__AVX512BW__)
  const __m512i pairs = _mm512_maddubs_epi16((__m512i)u, _mm512_set1_epi32(q));  // |15 * 127 * 2| < 2^15
  return acc + (v16i)_mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
#else
  int8_t qb[4];
  std::memcpy(qb, &q, sizeof qb);
  uint8_t ub[64];
  std::memcpy(ub, &u, sizeof ub);
  for (int c = 0; c < 16; ++c)
    acc[c] += int32_t(ub[4 * c]) * qb[0] + int32_t(ub[4 * c + 1]) * qb[1] + int32_t(ub[4 * c + 2]) * qb[2] +
              int32_t(ub[4 * c + 3]) * qb[3];
  return acc;
#endif
}

// A block's low and high nibbles as bytes.
static inline void Nibbles4(const Q4* block, v16i& lo, v16i& hi) {
  v16i v;
  std::memcpy(&v, block, sizeof v);
  const v16i mask = {0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F,
                     0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F,
                     0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F, 0x0F0F0F0F};
  lo = v & mask;
  hi = (v >> 4) & mask;
}

// The float32 total of a column after one more group: a[i] the sums of U * q_i.
static inline v16 Finish4(v16 total, const v16i (&a)[kPieces4], int32_t sum8, const v16& sw, float step) {
  const v16i t = (a[0] << 14) + (a[1] << 7) + a[2] - sum8;  // sum of (U - 8) * (q1 2^14 + q2 2^7 + q3)
  return total + __builtin_convertvector(t, v16) * (sw * step);
}

// y[r, ns[s]..+16] = rows[r] . panels[s] for R rows and S panels at once (S independent streams of
// weights, each with its own sums); `next`, when given, asked for ahead as the first panel streams.
// With few sums (S * R <= 2) each is kept as two, the even and odd blocks apart, so that more
// multiply-adds are in flight; integer sums come out the same either way.
template <int S, int R>
static inline void Tile4(const Row4* rows, int64_t K, const Q4* const* panels, const F16* const* scales,
                         const Q4* next, float* y, int64_t N, const int64_t* ns) {
  constexpr int kSplit = S * R <= 2 ? 2 : 1;
  v16 total[S][R] = {};
  for (int64_t g = 0; g < K / kGroup4; ++g) {
    v16i parts[kSplit][S][R][kPieces4] = {};
    for (int t = 0; t < 4; ++t) {
      auto& a = parts[t % kSplit];
      const int64_t at = (4 * g + t) * kBlock4;
#ifndef JAXDECODE_NO_PREFETCH
      if (next) __builtin_prefetch(next + at, 0, 2);
#endif
      for (int s = 0; s < S; ++s) {
#ifndef JAXDECODE_NO_PREFETCH
        if (S > 1) __builtin_prefetch(panels[s] + at + kAhead4, 0, 3);
#endif
        v16i lo, hi;
        Nibbles4(panels[s] + at, lo, hi);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = rows[r].q + g * kRowGroup4 + 8 * t;
          for (int i = 0; i < kPieces4; ++i) {
            a[s][r][i] = Dot4(a[s][r][i], lo, Bytes4(q + i * kGroup4));
            a[s][r][i] = Dot4(a[s][r][i], hi, Bytes4(q + i * kGroup4 + 4));
          }
        }
      }
    }
    for (int h = 1; h < kSplit; ++h)
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < R; ++r)
          for (int i = 0; i < kPieces4; ++i) parts[0][s][r][i] += parts[h][s][r][i];
    for (int s = 0; s < S; ++s) {
      const v16 sw = Widen(scales[s] + 16 * g);
      for (int r = 0; r < R; ++r)
        total[s][r] = Finish4(total[s][r], parts[0][s][r], rows[r].sum8[g], sw, rows[r].step[g]);
    }
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) std::memcpy(y + r * N + ns[s], &total[s][r], sizeof total[s][r]);
}

#if defined(__AVX512F__)
constexpr int kTile4 = 6;  // 6 rows x (3 + 1) accumulators and the nibbles: 27 of 32 registers
#else
constexpr int kTile4 = 2;
#endif

// Panel p (columns 16p..16p+16 of y) through every tile of rows; the first tile asks for the next
// panel when `more`.
static void OnePanel4(const Row4* rows, int64_t M, int64_t K, const Q4* wp, const F16* sp, float* y, int64_t N,
                      int64_t p, bool more) {
  const Q4* panel[1] = {wp + p * K * 8};
  const F16* scales[1] = {sp + p * (K / kGroup4) * 16};
  const Q4* next = more ? panel[0] + K * 8 : nullptr;
  const int64_t ns[1] = {16 * p};
  int64_t r = 0;
  for (; r + kTile4 <= M; r += kTile4)
    Tile4<1, kTile4>(rows + r, K, panel, scales, r == 0 ? next : nullptr, y + r * N, N, ns);
  const Q4* ahead = r == 0 ? next : nullptr;
  switch (M - r) {
#if defined(__AVX512F__)
    case 5: Tile4<1, 5>(rows + r, K, panel, scales, ahead, y + r * N, N, ns); break;
    case 4: Tile4<1, 4>(rows + r, K, panel, scales, ahead, y + r * N, N, ns); break;
    case 3: Tile4<1, 3>(rows + r, K, panel, scales, ahead, y + r * N, N, ns); break;
    case 2: Tile4<1, 2>(rows + r, K, panel, scales, ahead, y + r * N, N, ns); break;
#endif
    case 1: Tile4<1, 1>(rows + r, K, panel, scales, ahead, y + r * N, N, ns); break;
    default: break;
  }
}

// y[:, panels p0..p1) for R = 1 or 2 prepared rows (linear.h's Panels): S panels at a time from S
// stretches of the range, the panels left over as one more set of streams.
template <int S, int R>
static void Streams4(const Row4* rows, int64_t K, const Q4* wp, const F16* sp, float* y, int64_t N, int64_t p0,
                     int64_t p1) {
  const int64_t len = (p1 - p0) / S;
  for (int64_t j = 0; j < len; ++j) {
    const Q4* panels[S];
    const F16* scales[S];
    int64_t ns[S];
    for (int s = 0; s < S; ++s) {
      const int64_t p = p0 + s * len + j;
      panels[s] = wp + p * K * 8, scales[s] = sp + p * (K / kGroup4) * 16, ns[s] = 16 * p;
    }
    Tile4<S, R>(rows, K, panels, scales, nullptr, y, N, ns);
  }
  if constexpr (S > 1) {
    const int64_t rest = p0 + S * len;
    if (rest < p1) Streams4<S - 1, R>(rows, K, wp, sp, y, N, rest, p1);
  }
}

static void PanelsPrepared4(const Row4* rows, int64_t M, int64_t K, const Q4* wp, const F16* sp, float* y,
                            int64_t N, int64_t p0, int64_t p1) {
  if (M == 1) return Streams4<kStreams, 1>(rows, K, wp, sp, y, N, p0, p1);
  if (M == 2) return Streams4<2, 2>(rows, K, wp, sp, y, N, p0, p1);
  for (int64_t p = p0; p < p1; ++p) OnePanel4(rows, M, K, wp, sp, y, N, p, p + 1 < p1);
}

// A call's rows prepared once (Prepare4), in a buffer of the caller's.
struct Prepared4 {
  std::vector<int8_t> q;
  std::vector<float> step;
  std::vector<int32_t> sum8;
  std::vector<Row4> rows;

  void Resize(int64_t M, int64_t K) {
    const int64_t G = K / kGroup4;
    q.resize(M * G * kRowGroup4), step.resize(M * G), sum8.resize(M * G), rows.resize(M);
    for (int64_t r = 0; r < M; ++r) rows[r] = {q.data() + r * G * kRowGroup4, step.data() + r * G, sum8.data() + r * G};
  }
  // Values k0..k0+n of row r (k0 and n multiples of 32) from x.
  void Fill(int64_t r, int64_t K, const float* x, int64_t k0, int64_t n) {
    const int64_t g = (r * K + k0) / kGroup4;
    Prepare4(x, n, q.data() + g * kRowGroup4, step.data() + g, sum8.data() + g);
  }
};

// y[:, panels p0..p1) = x @ W for M rows of x, each prepared here (for callers that do not keep
// their rows prepared: every call prepares all M rows).
static void Panels4(const float* x, int64_t M, int64_t K, const Q4* wp, const F16* sp, float* y, int64_t N,
                    int64_t p0, int64_t p1) {
  thread_local Prepared4 prepared;
  prepared.Resize(M, K);
  for (int64_t r = 0; r < M; ++r) prepared.Fill(r, K, x + r * K, 0, K);
  PanelsPrepared4(prepared.rows.data(), M, K, wp, sp, y, N, p0, p1);
}

}  // namespace jaxdecode

#endif  // JAXDECODE_CSRC_LINEAR4_H_
