// Products for a few rows with the weights packed in panels of 16 columns, wp [N / 16, K, 16] (see
// kernels.pack): y = x @ w + b, then plus a residual or through GELU (the Epilogue). A panel is
// read in order, once, while a tile of y stays in registers. Used by packed_dense (dense.cc) and
// the decoder layer (layer.cc). Everything here is static: each source file that includes it gets
// its own copy, which the compiler inlines and specializes into that file's loops.

#ifndef JAXDECODE_CSRC_GEMM_H_
#define JAXDECODE_CSRC_GEMM_H_

#include <cstdint>

#include "common.h"

namespace jaxdecode {

// Keeps a loaded vector in a register: otherwise the compiler folds the load into every
// multiply-add that uses it, and the product becomes bound by loads instead of arithmetic.
static inline void InRegister(v8& x) {
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
static void PanelRows(const float* x, int64_t ldx, int64_t K, const float* panel, v8 (&acc)[R][2]) {
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
static inline v8 Erf(v8 x) {
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
static void PanelsR(const float* x, int64_t K, const float* wp, const float* b, float* y, int64_t N,
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

// y[:, cols of panels p0..p1) = x @ w + b (and the epilogue) for M rows, in tiles of rows that
// PanelsR keeps in registers.
static void Panels(const float* x, int64_t M, int64_t K, const float* wp, const float* b, float* y,
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

}  // namespace jaxdecode

#endif  // JAXDECODE_CSRC_GEMM_H_
