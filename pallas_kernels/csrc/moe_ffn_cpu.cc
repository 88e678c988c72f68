// Routed SwiGLU expert FFN for CPU, called from JAX through the XLA FFI.
//
// Why C++: XLA:CPU lowers a multi-token product against one expert's weight slice to a GEMM
// library call that first copies the slice, so an XLA "deduplicated" path reads each expert
// more than once. Here each expert's rows are streamed once for all of its tokens.
//
//   mode 0 (dedup):    (token, slot) pairs grouped by expert; each unique expert's Wg, Wu, Wd
//                      are streamed once per call, for all of its tokens together.
//   mode 1 (per_slot): one matrix-vector product per pair, in (token, slot) order; an expert
//                      chosen by m pairs is streamed m times (caches permitting).
//
// Work split: the expert hidden dimension F is cut into contiguous column ranges, one per
// chunk. A chunk computes h[:, f0:f1] from Wg/Wu columns f0:f1 and the partial output from Wd
// rows f0:f1, so chunks never wait on each other; their partial outputs are summed at the end.
// Chunks are claimed from an atomic counter by the caller and by tasks on XLA's intra-op thread
// pool, so the call completes even if no pool thread ever picks a task up.
//
// Layouts (row-major): x [T, D], ids/gates [T, K], Wg/Wu [E, D, F], Wd [E, F, D], y [T, D].

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kColBlock = 1024;  // columns of W per pass (keeps out[m, block] in L1/L2)
constexpr int64_t kRowTile = 8;     // rows of W combined per output load/store

// out[j, c0:c1] += sum_r in[j, r] * W[r, c0:c1] for j < m, r < R. W has row stride ldw.
// in is [m, R] (stride R), out is [m, ldo]. W is read once from memory: each tile of kRowTile
// rows by kColBlock columns stays in L1 while it is applied to all m tokens.
inline void MultiGemvAcc(const float* in, int64_t m, int64_t R, const float* W, int64_t ldw,
                         int64_t c0, int64_t c1, float* out, int64_t ldo) {
  for (int64_t cb = c0; cb < c1; cb += kColBlock) {
    const int64_t ce = std::min(c1, cb + kColBlock);
    const int64_t nc = ce - cb;
    int64_t r = 0;
    for (; r + kRowTile <= R; r += kRowTile) {
      const float* w0 = W + (r + 0) * ldw + cb;
      const float* w1 = W + (r + 1) * ldw + cb;
      const float* w2 = W + (r + 2) * ldw + cb;
      const float* w3 = W + (r + 3) * ldw + cb;
      const float* w4 = W + (r + 4) * ldw + cb;
      const float* w5 = W + (r + 5) * ldw + cb;
      const float* w6 = W + (r + 6) * ldw + cb;
      const float* w7 = W + (r + 7) * ldw + cb;
      for (int64_t j = 0; j < m; ++j) {
        const float* xj = in + j * R + r;
        const float a0 = xj[0], a1 = xj[1], a2 = xj[2], a3 = xj[3];
        const float a4 = xj[4], a5 = xj[5], a6 = xj[6], a7 = xj[7];
        float* __restrict__ o = out + j * ldo + cb;
#pragma GCC ivdep
        for (int64_t c = 0; c < nc; ++c) {
          o[c] += a0 * w0[c] + a1 * w1[c] + a2 * w2[c] + a3 * w3[c] + a4 * w4[c] + a5 * w5[c] +
                  a6 * w6[c] + a7 * w7[c];
        }
      }
    }
    for (; r < R; ++r) {
      const float* w0 = W + r * ldw + cb;
      for (int64_t j = 0; j < m; ++j) {
        const float a0 = in[j * R + r];
        float* __restrict__ o = out + j * ldo + cb;
#pragma GCC ivdep
        for (int64_t c = 0; c < nc; ++c) o[c] += a0 * w0[c];
      }
    }
  }
}

inline float Silu(float v) { return v / (1.0f + std::exp(-v)); }

struct Problem {
  const float* x;
  const int32_t* ids;
  const float* gates;
  const float* wg;
  const float* wu;
  const float* wd;
  int64_t T, K, D, F, E;
  bool dedup;
  // Pair groups: pairs_[group_start[g] .. group_start[g+1]) share expert group_expert[g].
  std::vector<int32_t> pairs;
  std::vector<int32_t> group_start;
  std::vector<int32_t> group_expert;
};

// One chunk: hidden columns [f0, f1); accumulates into y_part [T, D] (zero-initialised).
void RunChunk(const Problem& p, int64_t f0, int64_t f1, float* y_part) {
  const int64_t D = p.D, F = p.F, nf = f1 - f0;
  int64_t max_m = 0;
  for (size_t g = 0; g + 1 < p.group_start.size(); ++g) {
    max_m = std::max<int64_t>(max_m, p.group_start[g + 1] - p.group_start[g]);
  }
  std::vector<float> xs(max_m * D), hg(max_m * nf), hu(max_m * nf), out(max_m * D);
  for (size_t g = 0; g + 1 < p.group_start.size(); ++g) {
    const int64_t m = p.group_start[g + 1] - p.group_start[g];
    const int32_t* pr = p.pairs.data() + p.group_start[g];
    const int64_t e = p.group_expert[g];
    for (int64_t j = 0; j < m; ++j) {
      std::memcpy(xs.data() + j * D, p.x + (pr[j] / p.K) * D, D * sizeof(float));
    }
    std::fill(hg.begin(), hg.begin() + m * nf, 0.0f);
    std::fill(hu.begin(), hu.begin() + m * nf, 0.0f);
    // Columns f0:f1 of Wg[e], Wu[e]; out arrays indexed from f0 (shifted base pointer).
    MultiGemvAcc(xs.data(), m, D, p.wg + e * D * F, F, f0, f1, hg.data() - f0, nf);
    MultiGemvAcc(xs.data(), m, D, p.wu + e * D * F, F, f0, f1, hu.data() - f0, nf);
    for (int64_t i = 0; i < m * nf; ++i) hg[i] = Silu(hg[i]) * hu[i];
    std::fill(out.begin(), out.begin() + m * D, 0.0f);
    MultiGemvAcc(hg.data(), m, nf, p.wd + e * F * D + f0 * D, D, 0, D, out.data(), D);
    for (int64_t j = 0; j < m; ++j) {
      const float gj = p.gates[pr[j]];
      float* __restrict__ yt = y_part + (pr[j] / p.K) * D;
      const float* oj = out.data() + j * D;
#pragma GCC ivdep
      for (int64_t d = 0; d < D; ++d) yt[d] += gj * oj[d];
    }
  }
}

struct Shared {
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  int n_chunks = 1;
  Problem problem;
  std::vector<std::vector<float>> partial;  // per chunk [T, D]; chunk 0 writes y directly
  float* y = nullptr;

  void Work() {
    for (;;) {
      const int c = next.fetch_add(1);
      if (c >= n_chunks) return;
      const int64_t F = problem.F;
      // Column ranges aligned to 8 floats.
      auto bound = [&](int i) { return std::min<int64_t>(F, ((F * i / n_chunks) + 7) / 8 * 8); };
      const int64_t f0 = c == 0 ? 0 : bound(c), f1 = c + 1 == n_chunks ? F : bound(c + 1);
      float* dst = c == 0 ? y : partial[c].data();
      if (f1 > f0) RunChunk(problem, f0, f1, dst);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

int ThreadsWanted(int64_t pool_threads) {
  int n = static_cast<int>(std::thread::hardware_concurrency());
  if (pool_threads > 0) n = std::min<int>(n, static_cast<int>(pool_threads) + 1);
  if (const char* env = std::getenv("MOESPEC_FFI_THREADS")) n = std::atoi(env);
  return std::max(1, n);
}

ffi::Error MoeFfnImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                      ffi::Buffer<ffi::F32> gates, ffi::Buffer<ffi::F32> wg,
                      ffi::Buffer<ffi::F32> wu, ffi::Buffer<ffi::F32> wd,
                      ffi::ResultBuffer<ffi::F32> y, int32_t mode) {
  auto xd = x.dimensions(), idd = ids.dimensions(), wgd = wg.dimensions();
  if (xd.size() != 2 || idd.size() != 2 || wgd.size() != 3) {
    return ffi::Error::InvalidArgument("moe_ffn_cpu: expected x [T, D], ids [T, K], Wg [E, D, F]");
  }
  auto sh = std::make_shared<Shared>();
  Problem& p = sh->problem;
  p.T = xd[0];
  p.D = xd[1];
  p.K = idd[1];
  p.E = wgd[0];
  p.F = wgd[2];
  p.x = x.typed_data();
  p.ids = ids.typed_data();
  p.gates = gates.typed_data();
  p.wg = wg.typed_data();
  p.wu = wu.typed_data();
  p.wd = wd.typed_data();
  p.dedup = mode == 0;
  const int64_t R = p.T * p.K;
  for (int64_t r = 0; r < R; ++r) {
    if (p.ids[r] < 0 || p.ids[r] >= p.E) {
      return ffi::Error::InvalidArgument("moe_ffn_cpu: expert id out of range");
    }
  }
  if (p.dedup) {
    // Counting sort of pairs by expert (stable).
    std::vector<int32_t> count(p.E + 1, 0);
    for (int64_t r = 0; r < R; ++r) ++count[p.ids[r] + 1];
    for (int64_t e = 0; e < p.E; ++e) count[e + 1] += count[e];
    p.pairs.resize(R);
    std::vector<int32_t> fill(count.begin(), count.end() - 1);
    for (int64_t r = 0; r < R; ++r) p.pairs[fill[p.ids[r]]++] = static_cast<int32_t>(r);
    for (int64_t e = 0; e < p.E; ++e) {
      if (count[e + 1] > count[e]) {
        p.group_start.push_back(count[e]);
        p.group_expert.push_back(static_cast<int32_t>(e));
      }
    }
    p.group_start.push_back(static_cast<int32_t>(R));
  } else {
    p.pairs.resize(R);
    for (int64_t r = 0; r < R; ++r) {
      p.pairs[r] = static_cast<int32_t>(r);
      p.group_start.push_back(static_cast<int32_t>(r));
      p.group_expert.push_back(p.ids[r]);
    }
    p.group_start.push_back(static_cast<int32_t>(R));
  }
  float* yp = y->typed_data();
  std::memset(yp, 0, sizeof(float) * p.T * p.D);
  sh->y = yp;
  // At most one chunk per 64 hidden columns, so tiny layers do not pay for threads.
  sh->n_chunks = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(ThreadsWanted(pool.num_threads()), p.F / 64)));
  sh->partial.resize(sh->n_chunks);
  for (int c = 1; c < sh->n_chunks; ++c) sh->partial[c].assign(p.T * p.D, 0.0f);
  for (int c = 1; c < sh->n_chunks; ++c) {
    pool.Schedule([sh]() { sh->Work(); });
  }
  sh->Work();
  while (sh->done.load(std::memory_order_acquire) < sh->n_chunks) std::this_thread::yield();
  for (int c = 1; c < sh->n_chunks; ++c) {
    const float* src = sh->partial[c].data();
#pragma GCC ivdep
    for (int64_t i = 0; i < p.T * p.D; ++i) yp[i] += src[i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoespecMoeFfnF32, MoeFfnImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("mode"));
