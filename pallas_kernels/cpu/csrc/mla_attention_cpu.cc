// Multi-head latent attention (DeepSeek MLA) of a decoding pass against its compressed cache, for
// CPU, called from JAX through the XLA FFI.
//
// With the key up-projection absorbed into the queries, every query head of a row attends to one
// shared cache: keys are [latent ; rotary key] and values the latent itself. XLA:CPU ran the
// score and value products as batched dots over the heads plus a transpose of the probabilities,
// about a quarter of a batch-8 decode step of a DeepSeek-V2-layout model. Here each row's latent
// and rotary keys are streamed up to its last visible position for the scores (the queries, few,
// sit transposed in L1), the softmax runs down the positions for 16 query rows at once, and the
// latent is read again, from cache, for the values. 8 rows x 8 heads x 241 positions (C = 128,
// R = 16), 2 threads: 78 us against XLA's 118. The scores broadcast each latent value across one
// vector of queries, so a plain step (8 query rows, half a vector) uses half the lanes;
// verification passes (8 x (K + 1) rows) fill them.
//
// Layouts (row-major): q_lat [B, Q, C] and q_rope [B, Q, R] (scaled), latent [B, S, C], rope
// [B, S, R], limit [B, Q] (int32: query row i sees positions 0..limit[i]; limit < 0 sees none and
// returns zeros), out [B, Q, C]. Q = query rows of a cache row (tokens x heads).
//
// Work split: blocks of a row's query rows, at least one block per thread when there are fewer
// rows than threads; contiguous ranges of blocks of near-equal cost per slot (slots.h RunByCost). Each query row's arithmetic
// depends only on its own inputs (every product accumulates its terms in order, one multiply-add
// each, and the softmax runs down its own column), never on Q, on the block or on the thread: a
// plain step and a verification pass compute the same bits for the same row.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gemv.h"
#include "slots.h"
#include "vmath.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using moespec::ExpNonPositiveOf;
using moespec::F16;
using moespec::I16;
using moespec::kLanes;

struct Scratch {
  std::vector<float> q_t;       // [C + R, Qp]: the block's queries, transposed, zero-padded
  std::vector<float> scores_t;  // [visible, Qp]
  std::vector<float> probs;     // [rows, visible]
};

struct Problem {
  const float* q_lat;
  const float* q_rope;
  const float* latent;
  const float* rope;
  const int32_t* limit;
  float* out;
  int64_t B, Q, C, R, S;

  int64_t Seen(int64_t b, int64_t i) const {
    return std::max<int64_t>(0, std::min<int64_t>(limit[b * Q + i], S - 1) + 1);
  }

  // Query rows [i0, i1) of cache row b.
  void Rows(int64_t b, int64_t i0, int64_t i1, Scratch& w) const {
    const int64_t rows = i1 - i0;
    const int64_t qp = (rows + kLanes - 1) / kLanes * kLanes;
    float* out_QC = out + (b * Q + i0) * C;
    std::fill(out_QC, out_QC + rows * C, 0.0f);
    int64_t visible = 0;
    for (int64_t i = i0; i < i1; ++i) visible = std::max(visible, Seen(b, i));
    if (visible == 0) return;

    w.q_t.assign((C + R) * qp, 0.0f);
    for (int64_t j = 0; j < rows; ++j) {
      const float* ql = q_lat + (b * Q + i0 + j) * C;
      const float* qr = q_rope + (b * Q + i0 + j) * R;
      for (int64_t c = 0; c < C; ++c) w.q_t[c * qp + j] = ql[c];
      for (int64_t r = 0; r < R; ++r) w.q_t[(C + r) * qp + j] = qr[r];
    }
    // scores_t[s, j] = latent[s] . q_lat[j] + rope[s] . q_rope[j]: register panels of 8 positions
    // (8 independent sums per vector of queries; panels of 4, with the queries one vector wide,
    // wait on the multiply-adds' latency: 1.13x the whole kernel's time at 8 rows x 8 queries).
    w.scores_t.assign(visible * qp, 0.0f);
    const float* latent_SC = latent + b * S * C;
    moespec::PanelTiles<8>(latent_SC, visible, C, w.q_t.data(), qp, 0, qp, w.scores_t.data(), qp);
    if (R > 0) {
      moespec::PanelTiles<8>(rope + b * S * R, visible, R, w.q_t.data() + C * qp, qp, 0, qp, w.scores_t.data(), qp);
    }

    // Softmax down each query's column, 16 queries at a time, over the positions it sees.
    w.probs.assign(rows * visible, 0.0f);
    const F16 lowest = F16{} - 87.0f;
    for (int64_t g = 0; g < qp; g += kLanes) {
      I16 seen;
      for (int l = 0; l < kLanes; ++l) seen[l] = g + l < rows ? static_cast<int32_t>(Seen(b, i0 + g + l)) : 0;
      F16 top = F16{} - std::numeric_limits<float>::max();
      for (int64_t s = 0; s < visible; ++s) {
        F16 v;
        std::memcpy(&v, w.scores_t.data() + s * qp + g, sizeof(v));
        const I16 sv = I16{} + static_cast<int32_t>(s);
        top = sv < seen ? (v > top ? v : top) : top;
      }
      F16 total = {};
      for (int64_t s = 0; s < visible; ++s) {
        float* row = w.scores_t.data() + s * qp + g;
        F16 v;
        std::memcpy(&v, row, sizeof(v));
        const I16 sv = I16{} + static_cast<int32_t>(s);
        const F16 e = ExpNonPositiveOf<F16, I16>(v - top, lowest);
        v = sv < seen ? e : F16{};
        total += v;
        std::memcpy(row, &v, sizeof(v));
      }
      const F16 zero = {};
      const F16 inv = total > zero ? (zero + 1.0f) / total : zero;
      for (int l = 0; l < kLanes && g + l < rows; ++l) {
        float* p_S = w.probs.data() + (g + l) * visible;
        for (int64_t s = 0; s < visible; ++s) p_S[s] = w.scores_t[s * qp + g + l] * inv[l];
      }
    }
    // out[j, :] = sum_s p[j, s] latent[s, :]: the latent's rows streamed for all the block's rows.
    moespec::PanelGemvAcc(w.probs.data(), rows, visible, latent_SC, C, 0, C, out_QC, C);
  }
};

struct Block {
  int64_t b, i0, i1;
  double cost;
};

ffi::Error MlaAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q_lat, ffi::Buffer<ffi::F32> q_rope,
                            ffi::Buffer<ffi::F32> latent, ffi::Buffer<ffi::F32> rope, ffi::Buffer<ffi::S32> limit,
                            ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q_lat.dimensions(), rd = q_rope.dimensions(), ld = latent.dimensions(), kd = rope.dimensions(),
       md = limit.dimensions();
  if (qd.size() != 3 || rd.size() != 3 || ld.size() != 3 || kd.size() != 3 || md.size() != 2 ||
      rd[0] != qd[0] || rd[1] != qd[1] || ld[0] != qd[0] || ld[2] != qd[2] || kd[0] != qd[0] ||
      kd[1] != ld[1] || kd[2] != rd[2] || md[0] != qd[0] || md[1] != qd[1]) {
    return ffi::Error::InvalidArgument(
        "mla_attention_cpu: expected q_lat [B, Q, C], q_rope [B, Q, R], latent [B, S, C], rope [B, S, R], "
        "limit [B, Q]");
  }
  const Problem p{q_lat.typed_data(), q_rope.typed_data(), latent.typed_data(), rope.typed_data(),
                  limit.typed_data(), out->typed_data(), qd[0], qd[1], qd[2], rd[2], ld[1]};
  if (p.B == 0 || p.Q == 0) return ffi::Error::Success();
  const int threads = moespec::ThreadsWanted(pool.num_threads());
  const int64_t parts = std::min<int64_t>(p.Q, std::max<int64_t>(1, (threads + p.B - 1) / p.B));
  std::vector<Block> blocks;
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t k = 0; k < parts; ++k) {
      const int64_t i0 = p.Q * k / parts, i1 = p.Q * (k + 1) / parts;
      int64_t visible = 0;
      for (int64_t i = i0; i < i1; ++i) visible = std::max(visible, p.Seen(b, i));
      // Scores: each visible position against the queries padded to whole vectors; values: each row.
      const int64_t padded = (i1 - i0 + kLanes - 1) / kLanes * kLanes;
      blocks.push_back({b, i0, i1, static_cast<double>(padded + i1 - i0) * (visible + 1)});
    }
  }
  moespec::RunByCost(pool, blocks, [&](size_t u0, size_t u1) {
    Scratch w;
    for (size_t u = u0; u < u1; ++u) p.Rows(blocks[u].b, blocks[u].i0, blocks[u].i1, w);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoespecMlaAttentionF32, MlaAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
