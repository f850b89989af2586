// Decode attention through a block table (a paged KV cache) for the XLA CPU backend; its FFI
// handler JaxdecodePagedAttention. Each of a row's blocks is one segment of attend.h's kernels, read
// in place in the pool: no gather of the blocks into a contiguous buffer.
//
// Inputs (float32 unless noted):
//   q      [B, H, S, D]   queries
//   k, v   [N, H, BS, D]  the pool: N blocks of BS positions
//   tables [B, M] int32   row b's position p lies in block tables[b, p / BS] at offset p % BS
//   lim    [B, S] int32   query (b, s) sees positions t < lim[b, s] (at most M * BS)
// Output: out [B, H, S, D] = softmax(scale * q . keys) @ values over the visible positions (zeros
// for a query that sees nothing). A table entry that a query reads must lie in [0, N).
//
// JaxdecodePagedAttentionInt8 reads an int8 pool (models/base.py, Int8Blocks): k, v int8
// [N, H, BS, D] with float32 scales ks, vs [N, H, BS], a position's vector being q * scale. Each
// (row, head) reads back only the blocks its queries see, into a float buffer of its own, then
// attends as above: the pool is never read back whole.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attend.h"
#include "common.h"
#include "threads.h"

namespace jaxdecode {
namespace {

struct PagedProblem {
  const float *q, *k, *v;
  const int32_t *tables, *lim;
  float* out;
  int64_t B, H, S, D, N, BS, M;
  float scale;
};

// Every query of one (row, head) pair, one segment per block it sees.
void PagedRowHead(const PagedProblem& p, int64_t bh, std::vector<float>& scores, std::vector<Segment>& segs) {
  const int64_t b = bh / p.H, h = bh % p.H, D = p.D;
  for (int64_t s = 0; s < p.S; ++s) {
    const int64_t n = std::clamp<int64_t>(p.lim[b * p.S + s], 0, p.M * p.BS);
    const int64_t nb = (n + p.BS - 1) / p.BS;
    segs.resize(nb);
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t at = ((int64_t{p.tables[b * p.M + j]} * p.H + h) * p.BS) * D;
      segs[j] = {p.k + at, p.v + at, std::min(p.BS, n - j * p.BS)};
    }
    float* os = p.out + (bh * p.S + s) * D;
    if (n == 0)
      std::fill(os, os + D, 0.f);
    else
      Attend(p.q + (bh * p.S + s) * D, D, p.scale, segs.data(), static_cast<int>(nb), os, scores);
  }
}

// The shapes both handlers check (the pool's values have kd; k_count, v_count: its keys' and
// values' element counts); the first problem, or success.
template <typename Dims>
ffi::Error CheckShapes(const Dims& qd, const Dims& kd, const Dims& td, int64_t k_count, int64_t v_count,
                       int64_t lim_count) {
  auto bad = [](const char* what) { return ffi::Error::InvalidArgument(what); };
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2)
    return bad("paged_attention: q and the pool must have rank 4, the tables rank 2");
  if (kd[1] != qd[1] || kd[3] != qd[3]) return bad("paged_attention: the pool does not match q");
  if (v_count != k_count) return bad("paged_attention: values do not match keys");
  if (td[0] != qd[0]) return bad("paged_attention: the tables need one row per query row");
  if (lim_count != qd[0] * qd[2]) return bad("paged_attention: lim must be [B, S]");
  return ffi::Error::Success();
}

// Every table entry a query reads must name a block of the pool.
bool TablesInRange(const int32_t* tables, const int32_t* lim, int64_t B, int64_t S, int64_t M, int64_t BS,
                   int64_t N) {
  for (int64_t b = 0; b < B; ++b) {
    int64_t n = 0;
    for (int64_t s = 0; s < S; ++s) n = std::max<int64_t>(n, std::clamp<int64_t>(lim[b * S + s], 0, M * BS));
    for (int64_t j = 0; j < (n + BS - 1) / BS; ++j)
      if (tables[b * M + j] < 0 || tables[b * M + j] >= N) return false;
  }
  return true;
}

struct PagedInt8Problem {
  const float* q;
  const int8_t *k, *v;
  const float *ks, *vs;
  const int32_t *tables, *lim;
  float* out;
  int64_t B, H, S, D, N, BS, M;
  float scale;
};

// One (row, head) pair: the blocks its queries see, read back into kbuf, vbuf; then each query.
void PagedInt8RowHead(const PagedInt8Problem& p, int64_t bh, std::vector<float>& scores, std::vector<float>& kbuf,
                      std::vector<float>& vbuf) {
  const int64_t b = bh / p.H, h = bh % p.H, D = p.D, BS = p.BS;
  int64_t most = 0;
  for (int64_t s = 0; s < p.S; ++s) most = std::max<int64_t>(most, std::clamp<int64_t>(p.lim[b * p.S + s], 0, p.M * BS));
  kbuf.resize(most * D);
  vbuf.resize(most * D);
  for (int64_t t = 0; t < most; ++t) {
    const int64_t row = (int64_t{p.tables[b * p.M + t / BS]} * p.H + h) * BS + t % BS;
    const float sk = p.ks[row], sv = p.vs[row];
    const int8_t *kr = p.k + row * D, *vr = p.v + row * D;
    float *kd = kbuf.data() + t * D, *vd = vbuf.data() + t * D;
    for (int64_t j = 0; j < D; ++j) {
      kd[j] = static_cast<float>(kr[j]) * sk;
      vd[j] = static_cast<float>(vr[j]) * sv;
    }
  }
  for (int64_t s = 0; s < p.S; ++s) {
    const int64_t n = std::clamp<int64_t>(p.lim[b * p.S + s], 0, p.M * BS);
    float* os = p.out + (bh * p.S + s) * D;
    if (n == 0) {
      std::fill(os, os + D, 0.f);
      continue;
    }
    const Segment seg{kbuf.data(), vbuf.data(), n};
    Attend(p.q + (bh * p.S + s) * D, D, p.scale, &seg, 1, os, scores);
  }
}

ffi::Error PagedAttentionInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k,
                                  ffi::Buffer<ffi::F32> ks, ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> vs,
                                  ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lim,
                                  ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  auto bad = [](const char* what) { return ffi::Error::InvalidArgument(what); };
  if (auto e = CheckShapes(qd, kd, td, k.element_count(), v.element_count(), lim.element_count()); e.failure())
    return e;
  if (ks.element_count() * kd[3] != k.element_count() || vs.element_count() != ks.element_count())
    return bad("paged_attention: an int8 pool needs one scale per head and position");
  const PagedInt8Problem p{q.typed_data(), k.typed_data(), v.typed_data(), ks.typed_data(), vs.typed_data(),
                           tables.typed_data(), lim.typed_data(), out->typed_data(), qd[0], qd[1], qd[2],
                           qd[3], kd[0], kd[2], td[1], scale};
  if (!TablesInRange(p.tables, p.lim, p.B, p.S, p.M, p.BS, p.N))
    return bad("paged_attention: a block table entry lies outside the pool");
  int64_t seen = 0;
  for (int64_t i = 0; i < p.B * p.S; ++i) seen += std::clamp<int64_t>(p.lim[i], 0, p.M * p.BS);
  const int64_t work = seen * p.H * p.D;
  ParallelFor(pool, p.B * p.H, work >= (int64_t{1} << 20) ? pool.num_threads() : 1, [p](int64_t i) {
    thread_local std::vector<float> scores, kbuf, vbuf;
    PagedInt8RowHead(p, i, scores, kbuf, vbuf);
  });
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> tables,
                              ffi::Buffer<ffi::S32> lim, ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  auto bad = [](const char* what) { return ffi::Error::InvalidArgument(what); };
  if (auto e = CheckShapes(qd, kd, td, k.element_count(), v.element_count(), lim.element_count()); e.failure())
    return e;
  const PagedProblem p{q.typed_data(), k.typed_data(), v.typed_data(), tables.typed_data(), lim.typed_data(),
                       out->typed_data(), qd[0], qd[1], qd[2], qd[3], kd[0], kd[2], td[1], scale};
  if (!TablesInRange(p.tables, p.lim, p.B, p.S, p.M, p.BS, p.N))
    return bad("paged_attention: a block table entry lies outside the pool");
  const int64_t items = p.B * p.H;
  int64_t seen = 0;
  for (int64_t i = 0; i < p.B * p.S; ++i) seen += std::clamp<int64_t>(p.lim[i], 0, p.M * p.BS);
  const int64_t work = seen * p.H * p.D;
  ParallelFor(pool, items, work >= (int64_t{1} << 20) ? pool.num_threads() : 1, [p](int64_t i) {
    thread_local std::vector<float> scores;
    thread_local std::vector<Segment> segs;
    PagedRowHead(p, i, scores, segs);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxdecode

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdecodePagedAttention, jaxdecode::PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lim
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdecodePagedAttentionInt8, jaxdecode::PagedAttentionInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::S8>>()   // k pool (int8)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k scales
                                  .Arg<ffi::Buffer<ffi::S8>>()   // v pool (int8)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lim
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("scale"));
