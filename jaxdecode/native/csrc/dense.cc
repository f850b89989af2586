// Single products y = x @ w + b for a few rows, split over XLA's thread pool, and their FFI
// handlers: JaxdecodeDense on w as it is, [K, N], and JaxdecodePackedDense on w packed in panels
// (gemm.h).

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "gemm.h"
#include "threads.h"

namespace jaxdecode {
namespace {

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

// y = x @ w + b for a few rows, with w packed in panels of 16 columns: wp [N / 16, K, 16] (see
// kernels.pack). A panel is read in order, once, while a tile of y stays in registers (Panels in
// gemm.h); each thread takes a range of panels.

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

}  // namespace
}  // namespace jaxdecode

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdecodeDense, jaxdecode::DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdecodePackedDense, jaxdecode::PackedDenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // wp
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
