// Decode attention for the XLA CPU backend: few queries per row against a long KV cache; its FFI
// handler JaxdecodeDecodeAttention. The kernels themselves are in attend.h.
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
#include <cstdint>
#include <vector>

#include "attend.h"
#include "common.h"
#include "threads.h"

namespace jaxdecode {
namespace {

// One call's operands, as above.
struct Problem {
  const float *q, *k, *v, *k2, *v2;
  const int32_t *lim, *n2;
  float* out;
  int64_t B, H, S, D, C, L;
  float scale;
};

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

}  // namespace
}  // namespace jaxdecode

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdecodeDecodeAttention, jaxdecode::DecodeAttentionImpl,
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
