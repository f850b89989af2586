// The fused decoder layer and its FFI handler JaxdecodeDecodeLayer: LayerNorm, the packed products
// with their residual and GELU epilogues (gemm.h), attention over the cache (attend.h, plus the
// layer's variants for several queries at once), run as phases or as a pipeline over blocks of rows.
//
// A whole decoder layer for the rows of a decode pass (a step, a speculative verify pass):
//
//   h = LN1(x); q, k, v = split(h @ Wqkv + bqkv); x1 = x + attend(q, ...) @ Wo + bo
//   y = x1 + gelu(LN2(x1) @ W1 + b1) @ W2 + b2
//
// With a few rows a layer is bound by reading its weights (12 d^2 floats), yet XLA runs it as a
// dozen small operations of a few microseconds each. Here the layer is one call: its phases run on
// the calling thread and one pool task, which claim work items phase by phase (so a task that
// starts late, or never, only means the caller does more of the work) and wait for each other
// only between phases, spinning for the microsecond that takes. Many rows run as a pipeline
// instead (LayerPipeline, below).
//
// Inputs: x [R, d] (R = B * S, row b's S queries in order); the LayerNorm scales and biases [d];
// the dense kernels packed in panels of 16 columns (see kernels.pack) and their biases; the main
// cache k, v [B, H, C, hd] with lim [B, S]; the chunk buffer k2, v2 [B * H, L, hd] with n2 [B, S].
// Query (b, s) sees main positions t < lim[b, s], buffer positions t < n2[b, s] and the new
// positions 0..s of its own row. Outputs: y [R, d] and the new keys and values: [B, H, S, hd]
// (write 0), or written in place into the cache k, v at each row's lim[b, 0] (write 1) or into the
// buffer k2, v2 at n2[b, 0] (write 2), the outputs then being those buffers (aliased by the caller).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "attend.h"
#include "common.h"
#include "gemm.h"
#include "threads.h"

namespace jaxdecode {
namespace {

// out = (x - mean) / sqrt(variance + eps) * g + b over the d values of one row.
void LayerNorm(const float* x, const float* g, const float* b, float eps, int64_t d, float* out) {
  // d is a multiple of 16 (checked by the caller); two passes, eight lanes each
  v8 sum = {};
  for (int64_t i = 0; i < d; i += 8) sum += Load(x + i);
  const float mean = Sum(sum) / d;
  v8 ss = {};
  for (int64_t i = 0; i < d; i += 8) {
    const v8 c = Load(x + i) - mean;
    ss += c * c;
  }
  const float inv = 1.f / std::sqrt(Sum(ss) / d + eps);
  for (int64_t i = 0; i < d; i += 8) {
    const v8 o = (Load(x + i) - mean) * inv * Load(g + i) + Load(b + i);
    __builtin_memcpy(out + i, &o, sizeof o);
  }
}

// The layer's attention for several queries at once, on attend.h's kernels: all the heads of a
// row with one new position (AttendHeads), two new positions of a row that see the same cache
// positions (AttendPair).

// The D floats at p brought toward the core ahead of their use, one cache line at a time.
template <int64_t D>
static inline void PrefetchRow(const float* p) {
  for (int64_t l = 0; l < D; l += 16) __builtin_prefetch(p + l);
}

// Attend's attention (attend.h) for the G heads of one query position (G <= 8): head g's query
// q[g] over its segments segs[g * nseg ...], whose lengths are the same for every head. A core
// keeps more reads in flight over several streams than over one, so the heads' keys are read in
// turn, one position at a time, and then their values the same way (measured from DRAM on one
// core: about 18 GB/s over one stream, 25-28 GB/s over four to eight interleaved at 256 bytes,
// less at 1-4 KB); each head's arithmetic is exactly that of AttendVec.
template <int NV>
void AttendHeadsVec(const float* const* q, int G, float scale, const Segment* segs, int nseg,
                    float* const* out, std::vector<float>& scores) {
  constexpr int64_t D = 8 * NV;
  int64_t total_n = 0;
  for (int i = 0; i < nseg; ++i) total_n += segs[i].n;
  scores.resize(G * total_n);
  v8 qv[8][NV];
  float mx[8];
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < NV; ++j) qv[g][j] = Load(q[g] + 8 * j) * scale;
    mx[g] = -INFINITY;
  }
  // Each key (value) read also asks for the same position of the head's next segment: a paged
  // row's next block lies elsewhere in the pool, where the processor's own prefetching, which
  // follows a stream within a page, does not look.
  for (int i = 0, at = 0; i < nseg; at += segs[i].n, ++i)
    for (int64_t t = 0; t < segs[i].n; ++t)
      for (int g = 0; g < G; ++g) {
        if (i + 1 < nseg && t < segs[g * nseg + i + 1].n) PrefetchRow<D>(segs[g * nseg + i + 1].k + t * D);
        Scores<NV>(qv[g], segs[g * nseg + i].k + t * D, 1, scores.data() + g * total_n + at + t, mx[g]);
      }
  float inv[8];
  for (int g = 0; g < G; ++g) inv[g] = 1.f / ExpShift(scores.data() + g * total_n, total_n, mx[g]);
  v8 acc[8][NV] = {};
  for (int i = 0, at = 0; i < nseg; at += segs[i].n, ++i)
    for (int64_t t = 0; t < segs[i].n; ++t)
      for (int g = 0; g < G; ++g) {
        if (i + 1 < nseg && t < segs[g * nseg + i + 1].n) PrefetchRow<D>(segs[g * nseg + i + 1].v + t * D);
        Weighted<NV>(scores.data() + g * total_n + at + t, segs[g * nseg + i].v + t * D, 1, acc[g]);
      }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) {
      const v8 o = acc[g][j] * inv[g];
      __builtin_memcpy(out[g] + 8 * j, &o, sizeof o);
    }
}

// AttendHeadsVec where the head size allows it (a multiple of 8 up to 128, at most 8 heads, a
// query that sees something), else one head at a time.
void AttendHeads(const float* const* q, int G, int64_t D, float scale, const Segment* segs, int nseg,
                 float* const* out, std::vector<float>& scores) {
  int64_t total_n = 0;
  for (int i = 0; i < nseg; ++i) total_n += segs[i].n;
  if (G <= 8 && total_n > 0) switch (D) {
      case 16: return AttendHeadsVec<2>(q, G, scale, segs, nseg, out, scores);
      case 32: return AttendHeadsVec<4>(q, G, scale, segs, nseg, out, scores);
      case 64: return AttendHeadsVec<8>(q, G, scale, segs, nseg, out, scores);
      case 128: return AttendHeadsVec<16>(q, G, scale, segs, nseg, out, scores);
    }
  for (int g = 0; g < G; ++g) Attend(q[g], D, scale, segs + g * nseg, nseg, out[g], scores);
}

// Two queries over the same two segments of keys and values (plus one segment each of their own,
// the new positions they see): each shared key and value is read once for both.
template <int NV>
void AttendPairVec(const float* const* q, float scale, const Segment* shared, const Segment* own,
                   float* const* out, std::vector<float>& scores) {
  constexpr int64_t D = 8 * NV;
  const int64_t n_sh = shared[0].n + shared[1].n;
  const int64_t stride = n_sh + std::max(own[0].n, own[1].n);
  scores.resize(2 * stride);
  float* sc[2] = {scores.data(), scores.data() + stride};
  v8 qv[2][NV];
  for (int g = 0; g < 2; ++g)
    for (int j = 0; j < NV; ++j) qv[g][j] = Load(q[g] + 8 * j) * scale;
  float mx[2] = {-INFINITY, -INFINITY};
  for (int i = 0, at = 0; i < 2; at += shared[i].n, ++i) {
    const float* kb = shared[i].k;
    int64_t t = 0;
    v4 m4 = {mx[0], mx[0], mx[1], mx[1]};
    for (; t + 2 <= shared[i].n; t += 2) {  // two keys by two queries: four independent sums
      v8 a00 = {}, a01 = {}, a10 = {}, a11 = {};
      for (int j = 0; j < NV; ++j) {
        const v8 k0 = Load(kb + t * D + 8 * j), k1 = Load(kb + (t + 1) * D + 8 * j);
        a00 += qv[0][j] * k0, a01 += qv[0][j] * k1, a10 += qv[1][j] * k0, a11 += qv[1][j] * k1;
      }
      const v4 r = Sum4(a00, a01, a10, a11);  // [q0 k0, q0 k1, q1 k0, q1 k1]
      float rs[4];
      __builtin_memcpy(rs, &r, sizeof r);
      __builtin_memcpy(sc[0] + at + t, rs, 2 * sizeof(float));
      __builtin_memcpy(sc[1] + at + t, rs + 2, 2 * sizeof(float));
      m4 = Max4(m4, r);
    }
    mx[0] = std::max(m4[0], m4[1]);  // m4 started at mx
    mx[1] = std::max(m4[2], m4[3]);
    for (; t < shared[i].n; ++t) {
      v8 a0 = {}, a1 = {};
      for (int j = 0; j < NV; ++j) {
        const v8 k0 = Load(kb + t * D + 8 * j);
        a0 += qv[0][j] * k0, a1 += qv[1][j] * k0;
      }
      mx[0] = std::max(mx[0], sc[0][at + t] = Sum(a0));
      mx[1] = std::max(mx[1], sc[1][at + t] = Sum(a1));
    }
  }
  float inv[2];
  for (int g = 0; g < 2; ++g) {
    Scores<NV>(qv[g], own[g].k, own[g].n, sc[g] + n_sh, mx[g]);
    inv[g] = 1.f / ExpShift(sc[g], n_sh + own[g].n, mx[g]);
  }
  v8 acc[2][NV] = {};
  for (int i = 0, at = 0; i < 2; at += shared[i].n, ++i) {
    const float* vb = shared[i].v;
    for (int64_t t = 0; t < shared[i].n; ++t) {
      const v8 w0 = Splat(sc[0][at + t]), w1 = Splat(sc[1][at + t]);
      for (int j = 0; j < NV; ++j) {
        const v8 vv = Load(vb + t * D + 8 * j);
        acc[0][j] += w0 * vv, acc[1][j] += w1 * vv;
      }
    }
  }
  for (int g = 0; g < 2; ++g) {
    Weighted<NV>(sc[g] + n_sh, own[g].v, own[g].n, acc[g]);
    for (int j = 0; j < NV; ++j) {
      const v8 o = acc[g][j] * inv[g];
      __builtin_memcpy(out[g] + 8 * j, &o, sizeof o);
    }
  }
}

void AttendPair(const float* const* q, int64_t D, float scale, const Segment* shared, const Segment* own,
                float* const* out, std::vector<float>& scores) {
  switch (D / 8) {
    case 1: return AttendPairVec<1>(q, scale, shared, own, out, scores);
    case 2: return AttendPairVec<2>(q, scale, shared, own, out, scores);
    case 3: return AttendPairVec<3>(q, scale, shared, own, out, scores);
    case 4: return AttendPairVec<4>(q, scale, shared, own, out, scores);
    case 5: return AttendPairVec<5>(q, scale, shared, own, out, scores);
    case 6: return AttendPairVec<6>(q, scale, shared, own, out, scores);
    case 7: return AttendPairVec<7>(q, scale, shared, own, out, scores);
    case 8: return AttendPairVec<8>(q, scale, shared, own, out, scores);
    case 12: return AttendPairVec<12>(q, scale, shared, own, out, scores);
    case 16: return AttendPairVec<16>(q, scale, shared, own, out, scores);
    default:  // other head sizes: one query at a time
      for (int g = 0; g < 2; ++g) {
        const Segment segs[3] = {shared[0], shared[1], own[g]};
        Attend(q[g], D, scale, segs, 3, out[g], scores);
      }
  }
}

struct LayerProblem {
  const float *x, *g1, *be1, *wqkv, *bqkv, *wo, *bo, *g2, *be2, *w1, *b1, *w2, *b2;
  const float *k, *v, *k2, *v2;
  const int32_t *lim, *n2;
  float *y, *knew, *vnew;
  float *h, *qkv, *att, *x1, *f;  // scratch: [R, d], [R, 3d], [R, d], [R, d], [R, 4d]
  int64_t B, S, H, D, d, C, L;
  float scale, eps;
  // where the new keys and values go: 0 knew/vnew [B, H, S, D], 1 the cache, 2 the buffer, 3 a
  // block pool (kPool, below)
  int write;
  // write 3: k, v (and knew, vnew, aliased) are a pool [N, H, BS, D]; row b's position t lies in
  // block tables[b, t / BS] at offset t % BS (M columns). Query (b, s) sees pool positions
  // t < lim[b, s] and its row's new positions 0..s; the first counts[b] new positions are written
  // to the pool at lim[b, 0] + s. Their keys and values are also kept in own_k, own_v [B, H, S, D]
  // (scratch), so that a query reads them as one segment wherever the blocks lie.
  const int32_t *tables = nullptr, *counts = nullptr;
  float *own_k = nullptr, *own_v = nullptr;
  int64_t N = 0, BS = 1, M = 0;
  static constexpr int kPool = 3;
  int64_t R() const { return B * S; }

  // Offset (in floats) of row-head bh's first new key in knew and vnew: its S new positions are
  // consecutive. In the cache (buffer) they start at the row's first limit lim[b, 0] (count
  // n2[b, 0]), moved back to fit as XLA's dynamic_update_slice does.
  int64_t NewAt(int64_t bh) const {
    const int64_t b = bh / H;
    if (write == 1) return (bh * C + std::clamp<int64_t>(lim[b * S], 0, C - S)) * D;
    if (write == 2) return (bh * L + std::clamp<int64_t>(n2[b * S], 0, L - S)) * D;
    return bh * S * D;
  }

  // The most segments a query reads before its own new positions.
  int64_t MaxSeen() const { return write == kPool ? M : 2; }
};

// Phase i of the layer, work item j of `items(i)`; `split` items for each dense product.
struct LayerPhases {
  LayerProblem p;
  int64_t split;
  static constexpr int kPhases = 7;

  int64_t Items(int phase) const {
    switch (phase) {
      case 0: case 4: return p.R();       // LayerNorms, one row each
      case 2: return ByRow() ? p.B : p.B * p.H;  // attention, one row or one (row, head) each
      default: return split;              // dense products, a range of panels each
    }
  }

  // Attention by rows (all heads of a row together, see RowAttention) when there are enough rows
  // to share out.
  bool ByRow() const { return p.S == 1 && p.H <= 8 && p.B >= split; }

  // panels [p0, p1) of `panels` for item j
  void Range(int64_t panels, int64_t j, int64_t& p0, int64_t& p1) const {
    p0 = panels * j / split, p1 = panels * (j + 1) / split;
  }

  void Run(int phase, int64_t j) const {
    const int64_t R = p.R(), d = p.d;
    int64_t p0, p1;
    switch (phase) {
      case 0: return LayerNorm(p.x + j * d, p.g1, p.be1, p.eps, d, p.h + j * d);
      case 1: Range(3 * d / 16, j, p0, p1);
        return Panels(p.h, R, d, p.wqkv, p.bqkv, p.qkv, 3 * d, nullptr, kPlain, p0, p1);
      case 2: return ByRow() ? RowAttention(j) : Attention(j);
      case 3: Range(d / 16, j, p0, p1);
        return Panels(p.att, R, d, p.wo, p.bo, p.x1, d, p.x, kResidual, p0, p1);
      case 4: return LayerNorm(p.x1 + j * d, p.g2, p.be2, p.eps, d, p.h + j * d);
      case 5: Range(4 * d / 16, j, p0, p1);
        return Panels(p.h, R, d, p.w1, p.b1, p.f, 4 * d, nullptr, kGelu, p0, p1);
      case 6: Range(d / 16, j, p0, p1);
        return Panels(p.f, R, 4 * d, p.w2, p.b2, p.y, d, p.x1, kResidual, p0, p1);
    }
  }

  // Row-head bh's S new keys and values, copied from the QKV product to where they go (see
  // LayerProblem::NewAt); returns their addresses.
  // (With a pool: copied to own_k, own_v, and the row's first counts[b] written into its blocks.)
  void PlaceNew(int64_t bh, float*& kn, float*& vn) const {
    const int64_t b = bh / p.H, hh = bh % p.H, D = p.D, S = p.S, d = p.d;
    const bool pool = p.write == LayerProblem::kPool;
    kn = pool ? p.own_k + bh * S * D : p.knew + p.NewAt(bh);
    vn = pool ? p.own_v + bh * S * D : p.vnew + p.NewAt(bh);
    for (int64_t s = 0; s < S; ++s) {
      const float* row = p.qkv + (b * S + s) * 3 * d + hh * D;
      std::copy(row + d, row + d + D, kn + s * D);
      std::copy(row + 2 * d, row + 2 * d + D, vn + s * D);
    }
    if (!pool) return;
    const int64_t n = std::min<int64_t>(p.counts[b], S);
    for (int64_t s = 0; s < n; ++s) {  // positions and blocks checked by the handler
      const int64_t t = p.lim[b * S] + s;
      const int64_t at = ((int64_t{p.tables[b * p.M + t / p.BS]} * p.H + hh) * p.BS + t % p.BS) * D;
      std::copy(kn + s * D, kn + (s + 1) * D, p.knew + at);
      std::copy(vn + s * D, vn + (s + 1) * D, p.vnew + at);
    }
  }

  // The segments query s of row-head bh sees before its new positions (the cache and the buffer,
  // or a block of the pool each), at most p.MaxSeen(); returns how many.
  int Seen(int64_t bh, int64_t s, Segment* segs) const {
    const int64_t b = bh / p.H, i = b * p.S + s, D = p.D;
    if (p.write == LayerProblem::kPool) {
      const int64_t n = std::clamp<int64_t>(p.lim[i], 0, p.M * p.BS), nb = (n + p.BS - 1) / p.BS;
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t at = ((int64_t{p.tables[b * p.M + j]} * p.H + bh % p.H) * p.BS) * D;
        segs[j] = {p.knew + at, p.vnew + at, std::min(p.BS, n - j * p.BS)};
      }
      return static_cast<int>(nb);
    }
    segs[0] = {p.k + bh * p.C * D, p.v + bh * p.C * D, std::clamp<int64_t>(p.lim[i], 0, p.C)};
    segs[1] = {p.k2 + bh * p.L * D, p.v2 + bh * p.L * D, std::clamp<int64_t>(p.n2[i], 0, p.L)};
    return 2;
  }

  // Attention of every head of row b. With one query per row the heads are attended together
  // (AttendHeads); with several, head by head (Attention).
  void RowAttention(int64_t b) const {
    if (p.S != 1 || p.H > 8) {  // several queries per row: see Attention
      for (int64_t hh = 0; hh < p.H; ++hh) Attention(b * p.H + hh);
      return;
    }
    thread_local std::vector<float> scores;
    thread_local std::vector<Segment> segs;
    const int64_t D = p.D, d = p.d, H = p.H, most = p.MaxSeen() + 1;
    const float* qs[8];
    float* outs[8];
    segs.resize(H * most);
    int nseg = 0;  // the same for every head of the row
    for (int64_t hh = 0; hh < H; ++hh) {
      float *kn, *vn;
      PlaceNew(b * H + hh, kn, vn);
      nseg = Seen(b * H + hh, 0, segs.data() + hh * most);
      segs[hh * most + nseg] = {kn, vn, 1};
      qs[hh] = p.qkv + b * 3 * d + hh * D;
      outs[hh] = p.att + b * d + hh * D;
    }
    ++nseg;
    if (nseg != most)  // AttendHeads reads head g's segments at g * nseg: close the gaps
      for (int64_t hh = 1; hh < H; ++hh) std::copy_n(segs.data() + hh * most, nseg, segs.data() + hh * nseg);
    AttendHeads(qs, static_cast<int>(H), D, p.scale, segs.data(), nseg, outs, scores);
  }

  void Attention(int64_t bh) const {
    thread_local std::vector<float> scores;
    const int64_t b = bh / p.H, hh = bh % p.H, D = p.D, S = p.S, d = p.d;
    float *kn, *vn;
    PlaceNew(bh, kn, vn);
    auto query = [&](int64_t s) { return p.qkv + (b * S + s) * 3 * d + hh * D; };
    auto out = [&](int64_t s) { return p.att + (b * S + s) * d + hh * D; };
    auto shared = [&](int64_t s, Segment* segs) { Seen(bh, s, segs); };
    int64_t s = 0;
    if (D % 8 == 0 && D <= 128 && p.write != LayerProblem::kPool) {
      // pairs of queries that see the same cache positions read those keys and values once
      for (; s + 2 <= S; s += 2) {
        if (p.lim[b * S + s] != p.lim[b * S + s + 1] || p.n2[b * S + s] != p.n2[b * S + s + 1]) break;
        Segment segs[2];
        shared(s, segs);
        const Segment own[2] = {{kn, vn, s + 1}, {kn, vn, s + 2}};
        const float* qs[2] = {query(s), query(s + 1)};
        float* outs[2] = {out(s), out(s + 1)};
        AttendPair(qs, D, p.scale, segs, own, outs, scores);
      }
    }
    thread_local std::vector<Segment> segs;
    segs.resize(p.MaxSeen() + 1);
    for (; s < S; ++s) {
      const int n = Seen(bh, s, segs.data());
      segs[n] = {kn, vn, s + 1};
      Attend(query(s), D, p.scale, segs.data(), n + 1, out(s), scores);
    }
  }
};

// The same layer for many rows, as a pipeline over blocks of rows. In a large batch, attention
// streams the cache from memory while the products are bound by arithmetic on weights held in
// cache; run as phases, the two alternate and each leaves the other's resource idle. Here every
// block of rows goes through three tasks, in order: Q (LayerNorm and the QKV product), A (its
// attention) and P (projection, LayerNorm, feed-forward). Threads claim ready tasks, blocks in
// order within each kind; the calling thread prefers products (Q, then P) and the others prefer
// attention, so that one core streams the cache while the other multiplies, and either takes the
// other's work when its own kind has none ready. As in RunPhases, a thread that starts late (or
// never) leaves more of the work to the others and cannot block them.
constexpr int64_t kPipelineRows = 64, kPipelineBlock = 16;

struct LayerPipeline {
  LayerProblem p;
  LayerPhases phases;  // for its Attention(bh)
  int64_t rows_per_block;  // a multiple of S (whole rows of the batch)

  int64_t Blocks() const { return (p.R() + rows_per_block - 1) / rows_per_block; }

  // Rows [r0, r1) of block i.
  void Rows(int64_t i, int64_t& r0, int64_t& r1) const {
    r0 = i * rows_per_block, r1 = std::min(p.R(), r0 + rows_per_block);
  }

  // y rows [r0, r1) = x rows @ w + b (+ epilogue), panel by panel so that each panel is read
  // once from the shared cache for all the block's rows.
  static void BlockProduct(const float* x, int64_t M, int64_t K, const float* wp, const float* b, float* y,
                           int64_t N, const float* res, Epilogue ep) {
    for (int64_t q = 0; q < N / 16; ++q) Panels(x, M, K, wp, b, y, N, res, ep, q, q + 1);
  }

  void Q(int64_t i) const {
    int64_t r0, r1;
    Rows(i, r0, r1);
    const int64_t d = p.d;
    for (int64_t r = r0; r < r1; ++r) LayerNorm(p.x + r * d, p.g1, p.be1, p.eps, d, p.h + r * d);
    BlockProduct(p.h + r0 * d, r1 - r0, d, p.wqkv, p.bqkv, p.qkv + r0 * 3 * d, 3 * d, nullptr, kPlain);
  }

  void A(int64_t i) const {
    int64_t r0, r1;
    Rows(i, r0, r1);
    for (int64_t b = r0 / p.S; b < r1 / p.S; ++b) phases.RowAttention(b);
  }

  void P(int64_t i) const {
    int64_t r0, r1;
    Rows(i, r0, r1);
    const int64_t d = p.d, M = r1 - r0;
    BlockProduct(p.att + r0 * d, M, d, p.wo, p.bo, p.x1 + r0 * d, d, p.x + r0 * d, kResidual);
    for (int64_t r = r0; r < r1; ++r) LayerNorm(p.x1 + r * d, p.g2, p.be2, p.eps, d, p.h + r * d);
    BlockProduct(p.h + r0 * d, M, d, p.w1, p.b1, p.f + r0 * 4 * d, 4 * d, nullptr, kGelu);
    BlockProduct(p.f + r0 * 4 * d, M, 4 * d, p.w2, p.b2, p.y + r0 * d, d, p.x1 + r0 * d, kResidual);
  }
};

void RunPipeline(ffi::ThreadPool& pool, int64_t threads, const LayerPipeline& work) {
  const int64_t n = work.Blocks();
  struct State {
    std::atomic<int64_t> next[3];  // next block to claim, per kind (Q, A, P)
    std::atomic<int64_t> finished{0};  // P tasks done
    std::unique_ptr<std::atomic<char>[]> done;  // [kind * n + block]: Q and A tasks done
  };
  auto st = std::make_shared<State>();
  for (auto& c : st->next) c = 0;
  st->done.reset(new std::atomic<char>[2 * n]);
  for (int64_t i = 0; i < 2 * n; ++i) st->done[i] = 0;
  auto run = [st, work, n](bool streams) {
    // Claims the next block of `kind` if its previous stage is done; -1 if none is ready.
    auto claim = [&](int kind) -> int64_t {
      int64_t i = st->next[kind].load(std::memory_order_relaxed);
      while (i < n && (kind == 0 || st->done[(kind - 1) * n + i].load(std::memory_order_acquire))) {
        if (st->next[kind].compare_exchange_weak(i, i + 1)) return i;
      }
      return -1;
    };
    const int order[2][3] = {{0, 2, 1}, {1, 2, 0}};  // products first / attention first
    for (int spins = 0; st->finished.load(std::memory_order_acquire) < n;) {
      bool ran = false;
      for (int kind : order[streams]) {
        const int64_t i = claim(kind);
        if (i < 0) continue;
        if (kind == 0) work.Q(i);
        if (kind == 1) work.A(i);
        if (kind == 2) work.P(i);
        if (kind < 2) st->done[kind * n + i].store(1, std::memory_order_release);
        else st->finished.fetch_add(1, std::memory_order_release);
        ran = true;
        break;
      }
      if (ran) spins = 0;
      else if (++spins < 4096) Relax();
      else std::this_thread::yield();
    }
  };
  if (threads > 1) Share(pool, [run] { run(true); });
  for (int64_t t = 2; t < threads; ++t) pool.Schedule([run] { run(true); });
  run(false);
}

// Runs the layer problem `p` on the calling thread and up to a few of the pool's.
void RunLayer(ffi::ThreadPool& pool, const LayerProblem& p, int32_t schedule) {
  const int64_t R = p.R(), d = p.d, S = p.S;
  // More threads pay off once a layer's weights are a few hundred kilobytes. Every phase ends in
  // a wait for the slowest thread, so a few threads only (measured on two cores; a few rows give
  // little work per phase).
  const int64_t threads =
      12 * d * d >= (int64_t{1} << 17) ? std::clamp<int64_t>(pool.num_threads(), 1, 4) : 1;
  const LayerPhases phases{p, 2 * threads};
  // schedule: 0 = chosen here, 1 = phases, 2 = pipeline (the last two for tests and benchmarks).
  // The pipeline's blocks are about 16 rows, whole rows of the batch, at least one: it needs
  // several blocks per thread (a prefill of one 64-position prompt is one block, which one
  // thread would run alone).
  const int64_t per = std::max<int64_t>(1, kPipelineBlock / S) * S;
  if (schedule == 2 ||
      (schedule == 0 && threads >= 2 && R >= kPipelineRows && (R + per - 1) / per >= 2 * threads)) {
    RunPipeline(pool, threads, LayerPipeline{p, phases, per});
  } else {
    RunPhases(pool, threads, phases);
  }
}

// The layer's twelve weights, checked against the width d; the first mismatch, or success.
ffi::Error CheckWeights(const char* who, int64_t d, const ffi::Buffer<ffi::F32>* const* w) {
  const int64_t want[12] = {d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d};
  for (int i = 0; i < 12; ++i)
    if (static_cast<int64_t>(w[i]->element_count()) != want[i])
      return ffi::Error::InvalidArgument(std::string(who) + ": a weight does not match the width d");
  return ffi::Error::Success();
}

ffi::Error DecodeLayerImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> g1,
                           ffi::Buffer<ffi::F32> be1, ffi::Buffer<ffi::F32> wqkv, ffi::Buffer<ffi::F32> bqkv,
                           ffi::Buffer<ffi::F32> wo, ffi::Buffer<ffi::F32> bo, ffi::Buffer<ffi::F32> g2,
                           ffi::Buffer<ffi::F32> be2, ffi::Buffer<ffi::F32> w1, ffi::Buffer<ffi::F32> b1,
                           ffi::Buffer<ffi::F32> w2, ffi::Buffer<ffi::F32> b2, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lim, ffi::Buffer<ffi::F32> k2,
                           ffi::Buffer<ffi::F32> v2, ffi::Buffer<ffi::S32> n2, ffi::ResultBuffer<ffi::F32> y,
                           ffi::ResultBuffer<ffi::F32> knew, ffi::ResultBuffer<ffi::F32> vnew, float eps,
                           int32_t schedule, int32_t write) {
  auto bad = [](const char* what) { return ffi::Error::InvalidArgument(what); };
  auto xd = x.dimensions(), kd = k.dimensions(), k2d = k2.dimensions(), ld = lim.dimensions();
  if (xd.size() != 2 || kd.size() != 4 || k2d.size() != 3 || ld.size() != 2)
    return bad("decode_layer: expected x [R, d], k [B, H, C, hd], k2 [B*H, L, hd], lim [B, S]");
  const int64_t d = xd[1], B = kd[0], H = kd[1], C = kd[2], D = kd[3], S = ld[1];
  if (ld[0] != B || xd[0] != B * S || H * D != d || d % 16) return bad("decode_layer: shapes do not agree");
  if (k2d[0] != B * H || k2d[2] != D || v.element_count() != k.element_count() ||
      v2.element_count() != k2.element_count() || n2.element_count() != B * S)
    return bad("decode_layer: cache shapes do not agree");
  auto n = [](const ffi::Buffer<ffi::F32>& buf) { return static_cast<int64_t>(buf.element_count()); };
  const ffi::Buffer<ffi::F32>* w[12] = {&g1, &be1, &wqkv, &bqkv, &wo, &bo, &g2, &be2, &w1, &b1, &w2, &b2};
  if (auto e = CheckWeights("decode_layer", d, w); e.failure()) return e;
  const int64_t R = B * S;
  // write 1 (2): knew and vnew are k and v (k2 and v2), aliased, and the new positions go there
  const int64_t out_n = write == 1 ? n(k) : write == 2 ? n(k2) : R * d;
  if (write < 0 || write > 2 || knew->element_count() != out_n || vnew->element_count() != out_n)
    return bad("decode_layer: the outputs for the new keys and values do not match `write`");
  if ((write == 1 && S > C) || (write == 2 && S > k2d[1]))
    return bad("decode_layer: more new positions than the cache they are written to holds");
  // with aliasing the outputs are the inputs; read the keys there in case XLA copied them
  const float* kc = write == 1 ? knew->typed_data() : k.typed_data();
  const float* vc = write == 1 ? vnew->typed_data() : v.typed_data();
  const float* kb = write == 2 ? knew->typed_data() : k2.typed_data();
  const float* vb = write == 2 ? vnew->typed_data() : v2.typed_data();
  thread_local std::vector<float> scratch;
  scratch.resize(R * 10 * d);
  float* s = scratch.data();
  LayerProblem p{x.typed_data(), g1.typed_data(), be1.typed_data(), wqkv.typed_data(), bqkv.typed_data(),
                 wo.typed_data(), bo.typed_data(), g2.typed_data(), be2.typed_data(), w1.typed_data(),
                 b1.typed_data(), w2.typed_data(), b2.typed_data(), kc, vc, kb, vb, lim.typed_data(),
                 n2.typed_data(), y->typed_data(), knew->typed_data(), vnew->typed_data(), s, s + R * d,
                 s + 4 * R * d, s + 5 * R * d, s + 6 * R * d, B, S, H, D, d, C, k2d[1],
                 1.f / std::sqrt(static_cast<float>(D)), eps, write};
  RunLayer(pool, p, schedule);
  return ffi::Error::Success();
}

// The layer through a block table (write 3, see LayerProblem): x [R, d] with R = B * S, the
// weights, the pool k, v [N, H, BS, D] (aliased to the outputs), tables [B, M], lim [B, S],
// counts [B]. Outputs: y [R, d] and the pool with each row's first counts[b] new positions
// written at lim[b, 0] onwards.
ffi::Error PagedLayerImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> g1,
                          ffi::Buffer<ffi::F32> be1, ffi::Buffer<ffi::F32> wqkv, ffi::Buffer<ffi::F32> bqkv,
                          ffi::Buffer<ffi::F32> wo, ffi::Buffer<ffi::F32> bo, ffi::Buffer<ffi::F32> g2,
                          ffi::Buffer<ffi::F32> be2, ffi::Buffer<ffi::F32> w1, ffi::Buffer<ffi::F32> b1,
                          ffi::Buffer<ffi::F32> w2, ffi::Buffer<ffi::F32> b2, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lim,
                          ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::F32> y,
                          ffi::ResultBuffer<ffi::F32> knew, ffi::ResultBuffer<ffi::F32> vnew, float eps,
                          int32_t schedule) {
  auto bad = [](const char* what) { return ffi::Error::InvalidArgument(what); };
  auto xd = x.dimensions(), kd = k.dimensions(), td = tables.dimensions(), ld = lim.dimensions();
  if (xd.size() != 2 || kd.size() != 4 || td.size() != 2 || ld.size() != 2)
    return bad("paged_layer: expected x [R, d], the pool [N, H, BS, hd], tables [B, M], lim [B, S]");
  const int64_t d = xd[1], N = kd[0], H = kd[1], BS = kd[2], D = kd[3], B = td[0], M = td[1], S = ld[1];
  if (ld[0] != B || xd[0] != B * S || H * D != d || d % 16 || counts.element_count() != B)
    return bad("paged_layer: shapes do not agree");
  if (v.element_count() != k.element_count() || knew->element_count() != k.element_count() ||
      vnew->element_count() != k.element_count())
    return bad("paged_layer: the values or the outputs do not match the keys' pool");
  const ffi::Buffer<ffi::F32>* w[12] = {&g1, &be1, &wqkv, &bqkv, &wo, &bo, &g2, &be2, &w1, &b1, &w2, &b2};
  if (auto e = CheckWeights("paged_layer", d, w); e.failure()) return e;
  // every block a query reads, and every block a new position is written to, lies in the pool
  const int32_t *tab = tables.typed_data(), *lm = lim.typed_data(), *cn = counts.typed_data();
  for (int64_t b = 0; b < B; ++b) {
    int64_t seen = 0;
    for (int64_t s = 0; s < S; ++s) seen = std::max<int64_t>(seen, std::clamp<int64_t>(lm[b * S + s], 0, M * BS));
    const int64_t written = std::clamp<int64_t>(cn[b], 0, S);
    if (written > 0 && (lm[b * S] < 0 || lm[b * S] + written > M * BS))
      return bad("paged_layer: a new position lies past the row's block table");
    const int64_t last = std::max(seen, written > 0 ? lm[b * S] + written : 0);
    for (int64_t j = 0; j < (last + BS - 1) / BS; ++j)
      if (tab[b * M + j] < 0 || tab[b * M + j] >= N)
        return bad("paged_layer: a block table entry lies outside the pool");
  }
  const int64_t R = B * S;
  thread_local std::vector<float> scratch;
  scratch.resize(R * 12 * d);
  float* s = scratch.data();
  LayerProblem p{x.typed_data(), g1.typed_data(), be1.typed_data(), wqkv.typed_data(), bqkv.typed_data(),
                 wo.typed_data(), bo.typed_data(), g2.typed_data(), be2.typed_data(), w1.typed_data(),
                 b1.typed_data(), w2.typed_data(), b2.typed_data(), knew->typed_data(), vnew->typed_data(),
                 nullptr, nullptr, lm, nullptr, y->typed_data(), knew->typed_data(), vnew->typed_data(), s,
                 s + R * d, s + 4 * R * d, s + 5 * R * d, s + 6 * R * d, B, S, H, D, d, 0, 0,
                 1.f / std::sqrt(static_cast<float>(D)), eps, LayerProblem::kPool};
  p.tables = tab, p.counts = cn, p.own_k = s + 10 * R * d, p.own_v = s + 11 * R * d, p.N = N, p.BS = BS, p.M = M;
  RunLayer(pool, p, schedule);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxdecode

// The binding both layer handlers start with: the thread pool, x and the layer's twelve weights.
static auto LayerInputs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()   // x
      .Arg<ffi::Buffer<ffi::F32>>()   // ln1 scale
      .Arg<ffi::Buffer<ffi::F32>>()   // ln1 bias
      .Arg<ffi::Buffer<ffi::F32>>()   // qkv kernel, packed
      .Arg<ffi::Buffer<ffi::F32>>()   // qkv bias
      .Arg<ffi::Buffer<ffi::F32>>()   // proj kernel, packed
      .Arg<ffi::Buffer<ffi::F32>>()   // proj bias
      .Arg<ffi::Buffer<ffi::F32>>()   // ln2 scale
      .Arg<ffi::Buffer<ffi::F32>>()   // ln2 bias
      .Arg<ffi::Buffer<ffi::F32>>()   // ff1 kernel, packed
      .Arg<ffi::Buffer<ffi::F32>>()   // ff1 bias
      .Arg<ffi::Buffer<ffi::F32>>()   // ff2 kernel, packed
      .Arg<ffi::Buffer<ffi::F32>>();  // ff2 bias
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdecodeDecodeLayer, jaxdecode::DecodeLayerImpl,
                              LayerInputs()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lim
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k2
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v2
                                  .Arg<ffi::Buffer<ffi::S32>>()  // n2
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new keys
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new values
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("schedule")
                                  .Attr<int32_t>("write"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdecodePagedLayer, jaxdecode::PagedLayerImpl,
                              LayerInputs()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lim
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k pool, written
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v pool, written
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("schedule"));
