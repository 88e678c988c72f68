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
// Work split: a unit of work is one group's expert, or a range of at least kMinUnitCols hidden
// columns of it for wide experts: it computes h[:, f0:f1] from Wg/Wu columns f0:f1 and its part
// of the output from Wd rows f0:f1, so units never wait on each other. Whole experts keep each
// worker's reads contiguous: splitting a narrow expert's columns between workers reads rows in
// short strided pieces, which streamed at about half the bandwidth of one contiguous read here.
// Units are dealt to a few slots up front (balanced by estimated cost); slots are claimed from an
// atomic counter by the caller and by tasks on XLA's intra-op thread pool (so the call completes
// even if no pool thread ever picks a task up).
//
// A token's result does not depend on the pass it is in: each (token, slot) pair's gated output,
// per unit of columns, is kept apart, and a token's are summed at the end in a fixed order (its
// slots, then the units' columns), each computed with arithmetic that does not depend on how many
// tokens share the expert (gemv.h). So a token decoded alone (a plain step) and among a
// verification pass's tokens or a batch's rows gets the same bits, and greedy speculative
// decoding can emit exactly plain decoding's tokens. Passes whose kept outputs would exceed
// kPairOutputBytes (long prefills) sum into one output per slot instead, in slot order: the same
// from call to call, not across passes.
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

#include "gemv.h"
#include "slots.h"
#include "vmath.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using moespec::kManyRows;
using moespec::MultiGemvAcc;

constexpr int64_t kMinUnitCols = 1024;  // experts under twice this width are one unit (see above)
constexpr int64_t kPairOutputBytes = 64 << 20;  // most bytes of kept pair outputs (see above)

// kPairOutputBytes, or $MOESPEC_PAIR_OUTPUT_BYTES (tests reach the per-slot sums with it).
int64_t PairOutputBytes() {
  if (const char* env = std::getenv("MOESPEC_PAIR_OUTPUT_BYTES")) return std::atoll(env);
  return kPairOutputBytes;
}

struct Unit {
  int32_t group;
  int32_t piece;   // which of the expert's column ranges
  int32_t f0, f1;  // hidden columns
};

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
  std::vector<Unit> units;
  int64_t pieces = 1;    // column ranges per expert
  int64_t max_m = 0;     // pairs in the largest group
  int64_t max_cols = 0;  // hidden columns of the widest unit
};

struct Scratch {
  std::vector<float> xs, hg, hu, out;
  explicit Scratch(const Problem& p)
      : xs(p.max_m * p.D),
        hg(p.max_m * p.max_cols),
        hu(p.max_m * p.max_cols),
        out(p.max_m * p.D) {}
};

// One unit: group u.group's hidden columns [f0, f1). With pair_out [T * K, pieces, D], each pair's
// gated output is written there; otherwise it is added into y_part [T, D]. Each product prefetches
// the weights read next while it computes from cache (gemv.h): Wu after Wg, Wd after Wu, and the
// slot's next unit's Wg after Wd (`next`: nullptr for none), where they are contiguous (whole
// experts; Wd's rows always).
void RunUnit(const Problem& p, const Unit& u, const Unit* next, float* pair_out, float* y_part, Scratch& s) {
  const int64_t D = p.D, F = p.F, f0 = u.f0, nf = u.f1 - u.f0;
  const int64_t m = p.group_start[u.group + 1] - p.group_start[u.group];
  const int32_t* pr = p.pairs.data() + p.group_start[u.group];
  const int64_t e = p.group_expert[u.group];
  float* xs = s.xs.data();
  float* hg = s.hg.data();
  float* hu = s.hu.data();
  float* out = s.out.data();
  for (int64_t j = 0; j < m; ++j) {
    std::memcpy(xs + j * D, p.x + (pr[j] / p.K) * D, D * sizeof(float));
  }
  std::fill(hg, hg + m * nf, 0.0f);
  std::fill(hu, hu + m * nf, 0.0f);
  // Columns f0:f1 of Wg[e], Wu[e]; out arrays indexed from f0 (shifted base pointer).
  const bool whole = p.pieces == 1;
  const int64_t expert_bytes = D * F * static_cast<int64_t>(sizeof(float));
  const float* wd = p.wd + e * F * D + f0 * D;
  const float* next_wg = next != nullptr && whole ? p.wg + p.group_expert[next->group] * D * F : nullptr;
  MultiGemvAcc(xs, m, D, p.wg + e * D * F, F, f0, u.f1, hg - f0, nf, whole ? p.wu + e * D * F : nullptr,
               expert_bytes);
  MultiGemvAcc(xs, m, D, p.wu + e * D * F, F, f0, u.f1, hu - f0, nf, wd, nf * D * static_cast<int64_t>(sizeof(float)));
  moespec::SwigluInPlace(hg, hu, m * nf);
  std::fill(out, out + m * D, 0.0f);
  MultiGemvAcc(hg, m, nf, wd, D, 0, D, out, D, next_wg, expert_bytes);
  for (int64_t j = 0; j < m; ++j) {
    const float gj = p.gates[pr[j]];
    const float* oj = out + j * D;
    if (pair_out != nullptr) {
      float* __restrict__ kept = pair_out + (pr[j] * p.pieces + u.piece) * D;
#pragma GCC ivdep
      for (int64_t d = 0; d < D; ++d) kept[d] = gj * oj[d];
    } else {
      float* __restrict__ yt = y_part + (pr[j] / p.K) * D;
#pragma GCC ivdep
      for (int64_t d = 0; d < D; ++d) yt[d] += gj * oj[d];
    }
  }
}

// A slot's units in order, each told the next one (whose weights it prefetches): RunUnit.
void RunSlotUnits(const Problem& p, const std::vector<int32_t>& units, float* pair_out, float* y_part) {
  Scratch scratch(p);
  for (size_t i = 0; i < units.size(); ++i) {
    const Unit* next = i + 1 < units.size() ? &p.units[units[i + 1]] : nullptr;
    RunUnit(p, p.units[units[i]], next, pair_out, y_part, scratch);
  }
}

// Units: the groups with the most pairs first (dealt first), each cut into ranges of at least
// kMinUnitCols columns aligned to 8 floats.
void PlanUnits(Problem& p) {
  const int64_t G = static_cast<int64_t>(p.group_start.size()) - 1;
  std::vector<int32_t> order(G);
  for (int64_t g = 0; g < G; ++g) {
    order[g] = static_cast<int32_t>(g);
    p.max_m = std::max<int64_t>(p.max_m, p.group_start[g + 1] - p.group_start[g]);
  }
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return p.group_start[a + 1] - p.group_start[a] > p.group_start[b + 1] - p.group_start[b];
  });
  const int64_t pieces = std::max<int64_t>(1, p.F / kMinUnitCols);
  p.pieces = pieces;
  for (int32_t g : order) {
    for (int64_t i = 0; i < pieces; ++i) {
      const int64_t f0 = i == 0 ? 0 : (p.F * i / pieces + 7) / 8 * 8;
      const int64_t f1 = i + 1 == pieces ? p.F : (p.F * (i + 1) / pieces + 7) / 8 * 8;
      p.units.push_back({g, static_cast<int32_t>(i), static_cast<int32_t>(f0), static_cast<int32_t>(f1)});
      p.max_cols = std::max(p.max_cols, f1 - f0);
    }
  }
}

// Deals the units (most costly first) to n_slots slots, each to the least loaded slot; a unit
// costs its columns times (its pairs + kManyRows): weight reads, then arithmetic.
std::vector<std::vector<int32_t>> DealUnits(const Problem& p, int n_slots) {
  std::vector<std::vector<int32_t>> slots(n_slots);
  std::vector<int64_t> load(n_slots, 0);
  for (size_t i = 0; i < p.units.size(); ++i) {
    const Unit& u = p.units[i];
    const int64_t m = p.group_start[u.group + 1] - p.group_start[u.group];
    const int s = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    slots[s].push_back(static_cast<int32_t>(i));
    load[s] += (u.f1 - u.f0) * (m + kManyRows);
  }
  return slots;
}

ffi::Error MoeFfnImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                      ffi::Buffer<ffi::F32> gates, ffi::Buffer<ffi::F32> wg,
                      ffi::Buffer<ffi::F32> wu, ffi::Buffer<ffi::F32> wd,
                      ffi::ResultBuffer<ffi::F32> y, int32_t mode) {
  auto xd = x.dimensions(), idd = ids.dimensions(), wgd = wg.dimensions();
  if (xd.size() != 2 || idd.size() != 2 || wgd.size() != 3) {
    return ffi::Error::InvalidArgument("moe_ffn_cpu: expected x [T, D], ids [T, K], Wg [E, D, F]");
  }
  Problem p;
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
  PlanUnits(p);
  float* yp = y->typed_data();
  std::memset(yp, 0, sizeof(float) * p.T * p.D);
  const int n_slots = moespec::SlotsFor(pool, static_cast<int64_t>(p.units.size()));
  const std::vector<std::vector<int32_t>> slots = DealUnits(p, n_slots);
  const bool keep_pairs = R * p.pieces * p.D * static_cast<int64_t>(sizeof(float)) <= PairOutputBytes();
  if (keep_pairs) {
    // Every (pair, piece) is written by exactly one unit (no zero-fill needed); a token's are
    // summed in a fixed order.
    std::unique_ptr<float[]> pair_out(new float[R * p.pieces * p.D]);
    moespec::RunSlots(pool, n_slots, [&](int s) { RunSlotUnits(p, slots[s], pair_out.get(), nullptr); });
    for (int64_t t = 0; t < p.T; ++t) {
      float* __restrict__ yt = yp + t * p.D;
      for (int64_t i = 0; i < p.K * p.pieces; ++i) {
        const float* kept = pair_out.get() + (t * p.K * p.pieces + i) * p.D;
#pragma GCC ivdep
        for (int64_t d = 0; d < p.D; ++d) yt[d] += kept[d];
      }
    }
    return ffi::Error::Success();
  }
  // Each slot has its own output (slot 0 writes y), summed in slot order below.
  std::vector<std::vector<float>> partial(n_slots);
  for (int s = 1; s < n_slots; ++s) partial[s].assign(p.T * p.D, 0.0f);
  moespec::RunSlots(pool, n_slots, [&](int s) {
    RunSlotUnits(p, slots[s], nullptr, s == 0 ? yp : partial[s].data());
  });
  for (int s = 1; s < n_slots; ++s) {
    const float* src = partial[s].data();
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
