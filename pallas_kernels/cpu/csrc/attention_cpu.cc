// Attention of a decoding pass against a KV cache for CPU, called from JAX through the XLA FFI.
//
// Why C++: XLA:CPU runs the two products of a decode step, q.K and p.V, as batched dots of a few
// query rows against one (row, KV head) pair's cache at a time, at 8 GB/s of cache read in a
// batch-8 step; and it reads every cache position, the empty ones past the last query too. Here
// each pair's keys and values are streamed once, only up to its last visible position, and the
// softmax runs in between, in registers and L1.
//
// Layouts (row-major): q [N, Q, D] (scaled), keys [N, D, S] (key-major), values [N, S, D],
// limit [N, Q] (int32: query row i sees positions 0..limit[i]; limit < 0 sees none and returns
// zeros), out [N, Q, D]. N = batch rows x KV heads, Q = query rows per KV head.
//
// Draft trees (MoespecTreeAttentionF32): also a window per query row, base [N, Q] (int32) and
// bits [N, Q, kWindowWords] (int32 words, least significant first): of the positions up to its
// limit, row i sees those before base[i] and, in the window [base, base + 32 kWindowWords), those
// whose bit is set (itself and its ancestors in the tree). A masked position's weight is exactly 0.
//
// Work split: blocks of each pair's query rows (CausalBlocks), contiguous ranges of them per slot
// (slots.h). Each query row's arithmetic depends only on its own inputs, never on Q, on the blocks
// or on which thread ran it: a row's scores are the same whatever keys past its own a block
// reads, and those keys enter the values' sum with weight exactly 0.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv.h"
#include "slots.h"
#include "vmath.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using moespec::ExpNonPositiveOf;
using moespec::F1;
using moespec::F16;
using moespec::I1;
using moespec::I16;
using moespec::kLanes;

// Query rows and key positions of a causal block (CausalBlocks). A prefill's rows see ever more keys
// (t-major rows, causal): a block scores and reads keys only up to its own last row's position,
// about half the work of scoring every row against the longest, and the blocks spread one pair's
// rows over the threads.
constexpr int64_t kQueryBlock = 32;
// Words of a tree window's mask: windows of up to 128 positions.
constexpr int64_t kWindowWords = 4;

// x[s] = exp(x[s] - top) for s < n.
inline void ExpShifted(float* x, int64_t n, float top) {
  const F16 lowest = F16{} - 87.0f;
  int64_t s = 0;
  for (; s + kLanes <= n; s += kLanes) {
    F16 v;
    std::memcpy(&v, x + s, sizeof(v));
    v = ExpNonPositiveOf<F16, I16>(v - top, lowest);
    std::memcpy(x + s, &v, sizeof(v));
  }
  for (; s < n; ++s) {
    const F1 v = {x[s] - top};
    x[s] = ExpNonPositiveOf<F1, I1>(v, F1{-87.0f})[0];
  }
}

// Max and sum of x[0..n) in 16 lanes, then across them in a fixed order: vectorized, and the same
// bits for the same inputs.
inline float Max(const float* x, int64_t n) {
  float top = x[0];
  int64_t s = 0;
  if (n >= kLanes) {
    F16 lane;
    std::memcpy(&lane, x, sizeof(lane));
    for (s = kLanes; s + kLanes <= n; s += kLanes) {
      F16 v;
      std::memcpy(&v, x + s, sizeof(v));
      lane = lane > v ? lane : v;
    }
    for (int l = 0; l < kLanes; ++l) top = std::max(top, lane[l]);
  }
  for (; s < n; ++s) top = std::max(top, x[s]);
  return top;
}

inline float Sum(const float* x, int64_t n) {
  F16 lane = {};
  int64_t s = 0;
  for (; s + kLanes <= n; s += kLanes) {
    F16 v;
    std::memcpy(&v, x + s, sizeof(v));
    lane += v;
  }
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total += lane[l];
  for (; s < n; ++s) total += x[s];
  return total;
}

struct Problem {
  const float* q;
  const float* keys;
  const float* values;
  const int32_t* limit;
  float* out;
  int64_t N, Q, D, S;
  const int32_t* base = nullptr;  // tree windows (MoespecTreeAttentionF32), or none
  const uint32_t* bits = nullptr;

  // Whether row r (of pair n's Q) sees position s of its window's range (tree windows only).
  bool Masked(int64_t r, int64_t s) const {
    const int64_t rel = s - base[r];
    if (rel < 0 || rel >= 32 * kWindowWords) return false;
    return ((bits[r * kWindowWords + rel / 32] >> (rel % 32)) & 1u) == 0;
  }

  // Query rows [i0, i1) of pair n: scored against keys up to the last position any of them sees
  // (a prefill's early rows skip the later keys: causal blocks), softmax, then the values.
  void Rows(int64_t n, int64_t i0, int64_t i1, std::vector<float>& scores) const {
    const int64_t rows = i1 - i0;
    const float* q_QD = q + (n * Q + i0) * D;
    const float* k_DS = keys + n * D * S;
    const float* v_SD = values + n * S * D;
    const int32_t* lim_Q = limit + n * Q + i0;
    float* o_QD = out + (n * Q + i0) * D;
    int64_t visible = 0;
    for (int64_t i = 0; i < rows; ++i) visible = std::max<int64_t>(visible, std::min<int64_t>(lim_Q[i], S - 1) + 1);
    std::fill(o_QD, o_QD + rows * D, 0.0f);
    if (visible == 0) return;
    scores.assign(rows * visible, 0.0f);
    moespec::PanelGemvAcc(q_QD, rows, D, k_DS, S, 0, visible, scores.data(), visible);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t seen = std::min<int64_t>(lim_Q[i], S - 1) + 1;
      float* __restrict__ s_S = scores.data() + i * visible;
      if (seen <= 0) {
        std::fill(s_S, s_S + visible, 0.0f);
        continue;
      }
      const int64_t r = n * Q + i0 + i;
      if (base != nullptr) {  // masked positions leave the max, then weigh exactly 0
        const int64_t lo = std::max<int64_t>(0, base[r]), hi = std::min<int64_t>(seen, base[r] + 32 * kWindowWords);
        for (int64_t s = lo; s < hi; ++s)
          if (Masked(r, s)) s_S[s] = -3.0e38f;
        ExpShifted(s_S, seen, Max(s_S, seen));
        for (int64_t s = lo; s < hi; ++s)
          if (Masked(r, s)) s_S[s] = 0.0f;
      } else {
        ExpShifted(s_S, seen, Max(s_S, seen));
      }
      const float inv = 1.0f / Sum(s_S, seen);
#pragma GCC ivdep
      for (int64_t s = 0; s < seen; ++s) s_S[s] *= inv;
      std::fill(s_S + seen, s_S + visible, 0.0f);
    }
    // out[i, :] = sum_s p[i, s] v[s, :]: the values rows streamed once for all the block's rows.
    moespec::PanelGemvAcc(scores.data(), rows, visible, v_SD, D, 0, D, o_QD, D);
  }
};

struct Block {
  int64_t n, i0, i1;
  double cost;
};

// Pair n's query rows in blocks: a block holds at least kQueryBlock rows and ends before the first
// row that sees kQueryBlock more keys than the block's first row. A prefill's rows (t-major, each
// seeing its own position) fall into blocks of about kQueryBlock positions; a decoding pass's rows
// (within K + 1 positions of each other) stay one block, whose keys and values are read once.
void CausalBlocks(const Problem& p, int64_t n, std::vector<Block>& blocks) {
  const int32_t* lim_Q = p.limit + n * p.Q;
  auto seen = [&](int64_t i) { return std::max<int64_t>(0, std::min<int64_t>(lim_Q[i], p.S - 1) + 1); };
  int64_t i0 = 0, top = 0;
  for (int64_t i = 0; i < p.Q; ++i) {
    if (i - i0 >= kQueryBlock && seen(i) >= seen(i0) + kQueryBlock) {
      blocks.push_back({n, i0, i, static_cast<double>(i - i0) * (top + 1)});
      i0 = i;
      top = 0;
    }
    top = std::max(top, seen(i));
  }
  blocks.push_back({n, i0, p.Q, static_cast<double>(p.Q - i0) * (top + 1)});
}

ffi::Error Run(ffi::ThreadPool pool, const Problem& p) {
  if (p.N == 0 || p.Q == 0) return ffi::Error::Success();
  // Units of work: blocks of a pair's query rows (CausalBlocks), dealt to slots as contiguous
  // ranges of near-equal estimated cost (rows x keys read; RunByCost).
  std::vector<Block> blocks;
  for (int64_t n = 0; n < p.N; ++n) CausalBlocks(p, n, blocks);
  moespec::RunByCost(pool, blocks, [&](size_t u0, size_t u1) {
    std::vector<float> scores;
    for (size_t u = u0; u < u1; ++u) p.Rows(blocks[u].n, blocks[u].i0, blocks[u].i1, scores);
  });
  return ffi::Error::Success();
}

bool BadShapes(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& keys, ffi::Buffer<ffi::F32>& values,
               ffi::Buffer<ffi::S32>& limit) {
  auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions(), ld = limit.dimensions();
  return qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || ld.size() != 2 || kd[0] != qd[0] ||
         kd[1] != qd[2] || vd[0] != qd[0] || vd[1] != kd[2] || vd[2] != qd[2] || ld[0] != qd[0] ||
         ld[1] != qd[1];
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                         ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> limit,
                         ffi::ResultBuffer<ffi::F32> out) {
  if (BadShapes(q, keys, values, limit)) {
    return ffi::Error::InvalidArgument(
        "attention_cpu: expected q [N, Q, D], keys [N, D, S], values [N, S, D], limit [N, Q]");
  }
  auto qd = q.dimensions();
  const Problem p{q.typed_data(), keys.typed_data(), values.typed_data(), limit.typed_data(),
                  out->typed_data(), qd[0], qd[1], qd[2], keys.dimensions()[2]};
  return Run(pool, p);
}

ffi::Error TreeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                             ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> limit,
                             ffi::Buffer<ffi::S32> base, ffi::Buffer<ffi::S32> bits,
                             ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), bd = base.dimensions(), wd = bits.dimensions();
  if (BadShapes(q, keys, values, limit) || bd.size() != 2 || bd[0] != qd[0] || bd[1] != qd[1] ||
      wd.size() != 3 || wd[0] != qd[0] || wd[1] != qd[1] || wd[2] != kWindowWords) {
    return ffi::Error::InvalidArgument(
        "tree_attention_cpu: expected q [N, Q, D], keys [N, D, S], values [N, S, D], limit [N, Q], "
        "base [N, Q], bits [N, Q, 4]");
  }
  Problem p{q.typed_data(), keys.typed_data(), values.typed_data(), limit.typed_data(),
            out->typed_data(), qd[0], qd[1], qd[2], keys.dimensions()[2]};
  p.base = base.typed_data();
  p.bits = reinterpret_cast<const uint32_t*>(bits.typed_data());
  return Run(pool, p);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoespecAttentionF32, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoespecTreeAttentionF32, TreeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
