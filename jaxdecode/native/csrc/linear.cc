// The linear layers of the Hugging Face decoder: FFI handlers JaxdecodeLinearF32, ...BF16, ...F16
// and ...S8, y = x @ W for any number of rows on the packed product of linear.h, and ...Q4 on
// linear4.h's (int4 in groups of 32), the panels shared between the calling thread and the pool.

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "linear.h"
#include "linear4.h"
#include "threads.h"

namespace jaxdecode {
namespace {

template <ffi::DataType DT, typename T>
ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<DT> wp, ffi::Buffer<ffi::F32> s,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = wp.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != 16 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("linear: expected x [M, K] and wp [N/16, K, 16]");
  const int64_t M = xd[0], K = xd[1], panels = wd[0], N = 16 * panels;
  const bool scaled = s.element_count() != 0;
  if (scaled && s.element_count() != N) return ffi::Error::InvalidArgument("linear: expected a scale [N]");
  const float* xs = x.typed_data();
  const T* w = reinterpret_cast<const T*>(wp.untyped_data());
  const float* scale = scaled ? s.typed_data() : nullptr;
  float* ys = y->typed_data();
  if (M == 0) return ffi::Error::Success();
  // small products on the calling thread alone (a second thread costs more than it saves)
  const int64_t work = M * K * N;
  const int64_t threads = work < (int64_t{1} << 15) ? 1 : std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), panels));
  // twice as many ranges as threads: a thread that starts late takes fewer
  const int64_t items = std::min<int64_t>(panels, threads > 1 ? 2 * threads : 1);
  const int64_t per = (panels + items - 1) / items;
  const int64_t count = (panels + per - 1) / per;
  ParallelFor(pool, count, threads, [=](int64_t i) {
    Panels<T>(xs, M, K, w, scale, ys, N, i * per, std::min(panels, (i + 1) * per));
  });
  return ffi::Error::Success();
}

// An int4 product's two phases: each row prepared, then each range of panels.
struct PreparedProduct4 {
  static constexpr int kPhases = 2;
  const float* x;
  int64_t M, K;
  Prepared4* prepared;
  const Q4* w;
  const F16* s;
  float* y;
  int64_t N, panels, per, count;
  int64_t Items(int phase) const { return phase == 0 ? M : count; }
  void Run(int phase, int64_t i) const {
    if (phase == 0) return prepared->Fill(i, K, x + i * K, 0, K);
    PanelsPrepared4(prepared->rows.data(), M, K, w, s, y, N, i * per, std::min(panels, (i + 1) * per));
  }
};

ffi::Error LinearQ4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wp,
                        ffi::Buffer<ffi::F16> sp, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = wp.dimensions(), sd = sp.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != 16 || xd[1] != 2 * wd[1] || xd[1] % kGroup4)
    return ffi::Error::InvalidArgument("linear: expected x [M, K] (K a multiple of 32) and wp [N/16, K/2, 16]");
  const int64_t M = xd[0], K = xd[1], panels = wd[0], N = 16 * panels;
  if (sd.size() != 3 || sd[0] != panels || sd[1] != K / kGroup4 || sd[2] != 16)
    return ffi::Error::InvalidArgument("linear: expected int4 scales [N/16, K/32, 16]");
  const float* xs = x.typed_data();
  const Q4* w = reinterpret_cast<const Q4*>(wp.untyped_data());
  const F16* s = reinterpret_cast<const F16*>(sp.untyped_data());
  float* ys = y->typed_data();
  if (M == 0) return ffi::Error::Success();
  // the rows prepared once (linear4.h), one item a row, then the ranges of panels as LinearImpl's
  thread_local Prepared4 prepared;
  prepared.Resize(M, K);
  const int64_t work = M * K * 16 * panels;
  const int64_t threads = work < (int64_t{1} << 15) ? 1 : std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), panels));
  const int64_t items = std::min<int64_t>(panels, threads > 1 ? 2 * threads : 1);
  const int64_t per = (panels + items - 1) / items;
  RunPhases(pool, threads, PreparedProduct4{xs, M, K, &prepared, w, s, ys, N, panels, per, (panels + per - 1) / per});
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxdecode

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdecodeLinearQ4, jaxdecode::LinearQ4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // wp [N/16, K/2, 16]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scales [N/16, K/32, 16]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

#define JAXDECODE_LINEAR(NAME, DT, T)                                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, (jaxdecode::LinearImpl<DT, T>),                       \
                                ffi::Ffi::Bind()                                            \
                                    .Ctx<ffi::ThreadPool>()                                 \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* x */                   \
                                    .Arg<ffi::Buffer<DT>>()       /* wp */                  \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* scale, or empty */     \
                                    .Ret<ffi::Buffer<ffi::F32>>()); /* y */

JAXDECODE_LINEAR(JaxdecodeLinearF32, ffi::F32, float)
JAXDECODE_LINEAR(JaxdecodeLinearBF16, ffi::BF16, uint16_t)
JAXDECODE_LINEAR(JaxdecodeLinearF16, ffi::F16, jaxdecode::F16)
JAXDECODE_LINEAR(JaxdecodeLinearS8, ffi::S8, int8_t)
