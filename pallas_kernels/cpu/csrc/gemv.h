// Matrix-vector products for a few rows against row-major weights, streamed once from memory:
// the building blocks of the C++ CPU kernels (moe_ffn_cpu.cc, dense_cpu.cc).

#ifndef MOESPEC_CSRC_GEMV_H_
#define MOESPEC_CSRC_GEMV_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <thread>

#if defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vmath.h"

namespace moespec {

constexpr int64_t kColBlock = 1024;  // columns of W per row tile (keeps out[m, block] in L1/L2)
constexpr int64_t kRowTile = 8;     // rows of W combined per output load/store
constexpr int64_t kPrefetchRows = 16;   // rows of W ahead that a panel prefetches
constexpr int64_t kManyRows = 8;        // tokens from which a product is compute-bound
constexpr int kTileRows = 6;            // tokens per register panel against a W block in L2
constexpr int64_t kCachedPanelBytes = 1 << 20;  // W blocks up to this size are re-read from L2

// The register panels' vector: a 512-bit register with AVX-512; without it a 256-bit one. (GCC
// lowers 64-byte vectors to pairs of 256-bit operations there, and panels of them ran at a tenth
// of the multiply-add rate of the same panels in 256-bit vectors:
// docs/findings/2026-12-06-avx2-dense-panels.md.) An output element's arithmetic does not depend
// on the vector width: one fused multiply-add per term, in row order.
#if defined(__AVX512F__)
typedef F16 Vec;
#else
typedef float Vec __attribute__((vector_size(32), aligned(4)));
#endif
constexpr int kVecLanes = sizeof(Vec) / sizeof(float);

// acc + a * w, each lane rounded once (a fused multiply-add). The tail columns use std::fma, so a
// column's bits must not depend on whether the compiler contracted a panel's multiply and add:
// with 256-bit vectors GCC left some panel shapes uncontracted (Panel<1..3, 1>), so they say it.
inline Vec FusedMulAdd(float a, Vec w, Vec acc) {
#if defined(__AVX512F__)
  return acc + a * w;
#elif defined(__FMA__)
  return reinterpret_cast<Vec>(_mm256_fmadd_ps(_mm256_set1_ps(a), reinterpret_cast<__m256>(w), reinterpret_cast<__m256>(acc)));
#else
  for (int l = 0; l < kVecLanes; ++l) acc[l] = std::fma(a, w[l], acc[l]);
  return acc;
#endif
}

// Keeps a loaded weight vector in a register. Without this GCC folds the load into each of the M > 1
// multiply-adds that use it (M loads of one vector per row): 4-token panels against a W block in
// L2 ran at half the speed of 5-token ones (89 against 193 GFLOPS on one core, 192 x 256 x 320).
inline void InRegister(Vec& v) {
#if defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// Another weight block to bring into cache while panels read W from cache (Panel<M, P, true>: the
// tiles after the first): `per_row` 64-byte lines per row of W, from `next` up to `end`. A product
// whose first tile streams W from memory and whose other tiles only compute would otherwise leave
// memory idle while they run; with the next block on its way, its own first tile finds it in cache.
struct Prefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t per_row = 0;
};

// out[j, 0:kVecLanes P] += sum_r in[j * ldi + r] * W[r * ldw + 0:kVecLanes P] for j < M, r < R: M x P
// accumulators stay in registers while the W panel is read once, row after row (for M = 1 and
// a whole row, one sequential stream). With kNext, each row prefetches lines of another block
// (Prefetch) instead of W's own rows ahead.
template <int M, int P, bool kNext = false>
inline void Panel(const float* in, int64_t ldi, int64_t R, const float* W, int64_t ldw, float* out,
                  int64_t ldo, Prefetch* pf = nullptr) {
  Vec acc[M][P];
#pragma GCC unroll 8
  for (int j = 0; j < M; ++j) {
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p) acc[j][p] = *reinterpret_cast<const Vec*>(out + j * ldo + kVecLanes * p);
  }
  for (int64_t r = 0; r < R; ++r) {
    const float* w = W + r * ldw;
    if constexpr (kNext) {
      for (int64_t k = 0; k < pf->per_row && pf->next < pf->end; ++k, pf->next += 64) {
        __builtin_prefetch(pf->next, 0, 2);
      }
    } else {
#pragma GCC unroll 32
      for (int p = 0; p < P; p += 16 / kVecLanes) __builtin_prefetch(w + kPrefetchRows * ldw + kVecLanes * p);
    }
    float a[M];
#pragma GCC unroll 8
    for (int j = 0; j < M; ++j) a[j] = in[j * ldi + r];
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p) {
      Vec wv = *reinterpret_cast<const Vec*>(w + kVecLanes * p);
      if constexpr (M > 1) InRegister(wv);
#pragma GCC unroll 8
      for (int j = 0; j < M; ++j) acc[j][p] = FusedMulAdd(a[j], wv, acc[j][p]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < M; ++j) {
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p) *reinterpret_cast<Vec*>(out + j * ldo + kVecLanes * p) = acc[j][p];
  }
}

// Panel<M, nv> for a run-time nv <= P.
template <int M, int P, bool kNext = false>
inline void PanelOf(int nv, const float* in, int64_t ldi, int64_t R, const float* W, int64_t ldw,
                    float* out, int64_t ldo, Prefetch* pf = nullptr) {
  if (nv == P) {
    Panel<M, P, kNext>(in, ldi, R, W, ldw, out, ldo, pf);
  } else if constexpr (P > 1) {
    PanelOf<M, P - 1, kNext>(nv, in, ldi, R, W, ldw, out, ldo, pf);
  }
}

// Most vectors (Vec) per panel for M tokens: M x P accumulators + a weight vector + M broadcasts
// within the vector registers (32 AVX-512 registers; 16 without AVX-512).
template <int M>
constexpr int MaxPanel() {
#if defined(__AVX512F__)
  return M == 1 ? 24 : M == 2 ? 12 : M == 3 ? 8 : M == 4 ? 6 : M <= 6 ? 4 : M == 7 ? 3 : 2;
#else
  return M == 1 ? 12 : M == 2 ? 6 : M == 3 ? 4 : M == 4 ? 3 : M <= 6 ? 2 : 1;
#endif
}

// Columns [c0, c1) for M tokens: the 16-float vectors in near-equal panels of at most
// MaxPanel<M>() vectors, then the remaining columns one at a time, each term a fused multiply-add
// as in the panels (built with -ffp-contract=fast): a column's bits do not depend on whether it
// falls in a panel or in the tail (attention's rows see different numbers of keys alone and in a
// verification pass; a product in the tail rounded apart from its sum differed in the last bit).
template <int M, bool kNext = false>
inline void Tile(const float* in, int64_t ldi, int64_t R, const float* W, int64_t ldw, int64_t c0,
                 int64_t c1, float* out, int64_t ldo, Prefetch* pf = nullptr) {
  constexpr int kMax = MaxPanel<M>();
  const int64_t nv = (c1 - c0) / kVecLanes;
  const int64_t panels = (nv + kMax - 1) / kMax;
  int64_t c = c0;
  for (int64_t i = 0; i < panels; ++i) {
    const int p = static_cast<int>(nv * (i + 1) / panels - nv * i / panels);
    PanelOf<M, kMax, kNext>(p, in, ldi, R, W + c, ldw, out + c, ldo, pf);
    c += kVecLanes * p;
  }
  for (; c < c1; ++c) {
    for (int j = 0; j < M; ++j) {
      float s = out[j * ldo + c];
      for (int64_t r = 0; r < R; ++r) s = std::fma(in[j * ldi + r], W[r * ldw + c], s);
      out[j * ldo + c] = s;
    }
  }
}

// Wide rows: out[j, c0:c1] += sum_r in[j, r] * W[r, c0:c1] for j < m, r < R; in is [m, R]
// (stride R), out is [m, ldo], W has row stride ldw. W is read once from memory, in tiles of
// kRowTile rows by kColBlock columns (long contiguous pieces of each row) that stay in L1 while
// they are applied to all m tokens.
inline void RowTileGemvAcc(const float* in, int64_t m, int64_t R, const float* W, int64_t ldw,
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

// Columns [c0, c1) for tokens [0, m) in tiles of M (the last one shorter), register panels
// (MaxPanel<M>() vectors at most each); the tokens' inputs at stride ldi (>= R: R rows of a longer
// input, as ChunkedPanelTiles reads them).
template <int M, bool kNext = false>
inline void StridedPanelTiles(const float* in, int64_t ldi, int64_t m, int64_t R, const float* W, int64_t ldw,
                              int64_t c0, int64_t c1, float* out, int64_t ldo, Prefetch* pf = nullptr) {
  int64_t j = 0;
  for (; j + M <= m; j += M) Tile<M, kNext>(in + j * ldi, ldi, R, W, ldw, c0, c1, out + j * ldo, ldo, pf);
  if constexpr (M > 1) {
    if (j < m) StridedPanelTiles<M - 1, kNext>(in + j * ldi, ldi, m - j, R, W, ldw, c0, c1, out + j * ldo, ldo, pf);
  }
}

// StridedPanelTiles over whole inputs (in is [m, R]).
template <int M, bool kNext = false>
inline void PanelTiles(const float* in, int64_t m, int64_t R, const float* W, int64_t ldw,
                       int64_t c0, int64_t c1, float* out, int64_t ldo, Prefetch* pf = nullptr) {
  StridedPanelTiles<M, kNext>(in, R, m, R, W, ldw, c0, c1, out, ldo, pf);
}

// Tokens m (1..kTileRows) in one tile: Tile<m> for a run-time m.
inline void TileOf(int64_t m, const float* in, int64_t R, const float* W, int64_t ldw, int64_t c0,
                   int64_t c1, float* out, int64_t ldo) {
  switch (m) {
    case 1: return Tile<1>(in, R, R, W, ldw, c0, c1, out, ldo);
    case 2: return Tile<2>(in, R, R, W, ldw, c0, c1, out, ldo);
    case 3: return Tile<3>(in, R, R, W, ldw, c0, c1, out, ldo);
    case 4: return Tile<4>(in, R, R, W, ldw, c0, c1, out, ldo);
    case 5: return Tile<5>(in, R, R, W, ldw, c0, c1, out, ldo);
    default: return Tile<kTileRows>(in, R, R, W, ldw, c0, c1, out, ldo);
  }
}

// The most tokens (at most kTileRows) whose register panel spans nv <= MaxPanel<1>() vectors.
inline int64_t WholeRowTokens(int64_t nv) {
  constexpr int kPanels[kTileRows] = {MaxPanel<1>(), MaxPanel<2>(), MaxPanel<3>(),
                                      MaxPanel<4>(), MaxPanel<5>(), MaxPanel<6>()};
  int64_t tokens = 1;
  for (int64_t k = 1; k <= kTileRows; ++k) {
    if (nv <= kPanels[k - 1]) tokens = k;
  }
  return tokens;
}

// Register panels for m tokens over W read once from memory, in chunks of rows that stay in L1
// while every token tile reads them: each chunk is streamed by the first tile and re-read from L1
// by the others. The accumulators go through `out` between chunks (exact), so every output
// element still takes one fused multiply-add per term in row order: the same bits as one
// token's Panel over all R rows. Without AVX-512 (16 vector registers) the panels of several
// tokens are narrow, and reading a W block from L2 or memory in their short strided pieces ran
// at a fraction of the single-token stream (docs/findings/2026-12-06-avx2-dense-panels.md).
constexpr int64_t kChunkBytes = 16 << 10;
constexpr int kChunkTileRows = 4;

inline void ChunkedPanelTiles(const float* in, int64_t m, int64_t R, const float* W, int64_t ldw, int64_t c0,
                              int64_t c1, float* out, int64_t ldo) {
  const int64_t rows = std::max<int64_t>(8, kChunkBytes / ((c1 - c0) * static_cast<int64_t>(sizeof(float))));
  // Each chunk's lines are requested in order while the previous chunk computes from L1, so W
  // streams from memory as one sequential read.
  auto request = [&](int64_t r0) {
    for (int64_t r = r0; r < std::min(R, r0 + rows); ++r) {
      for (int64_t c = c0; c < c1; c += 16) __builtin_prefetch(W + r * ldw + c, 0, 3);
    }
  };
  request(0);
  for (int64_t r0 = 0; r0 < R; r0 += rows) {
    request(r0 + rows);
    StridedPanelTiles<kChunkTileRows>(in + r0, R, m, std::min(rows, R - r0), W + r0 * ldw, ldw, c0, c1, out, ldo);
  }
}

// out[j, c0:c1] += sum_r in[j, r] * W[r, c0:c1] for j < m, r < R. in is [m, R] (stride R),
// out is [m, ldo], W has row stride ldw. Without AVX-512: ChunkedPanelTiles. With it, three regimes:
//  - several tokens and a W block that stays in L2 (verification passes and prefills of small
//    experts): register panels for tiles of up to kTileRows tokens, W read from memory by the
//    first tile and from L2 by the others (192 x 256 x 128 on one core, W in cache: 92 GFLOPS,
//    about 80% of the multiply-add peak measured here). The first tile streams whole rows: where
//    a tile of min(m, 6) tokens would cut each row into several panels, the first tile is the
//    most tokens whose panel spans the row. Panels reading parts of rows from memory streamed at
//    5-7 GB/s on one core against 15 for whole rows (Wd 128 x 256, 2-6 tokens; Wg 256 x 128,
//    4-6 tokens). While the other tiles compute from cache, they prefetch `next_bytes` from
//    `next` (the weights the caller reads next; none: nullptr): one core, 256 x 128 and
//    128 x 256 blocks out of cache one after another, with against without, same build, three
//    runs: 1.26-1.44x the GFLOPS at 12 tokens, 1.11-1.32x at 24;
//  - narrow rows (the whole column range in one register panel): each W row is read in one
//    contiguous piece, tokens in the largest tiles whose accumulators fit in registers (later
//    tiles re-read W from cache);
//  - wide rows: row tiles (RowTileGemvAcc), whose long pieces stream well. Register panels
//    there read short strided pieces, a 4 KB page per row, and streamed at 65-90% of the
//    row-tile rate for DeepSeek-V2-Lite, Qwen3-30B-A3B and Mixtral-8x7B expert shapes.
// An output element's arithmetic depends on R and the column range, never on m: rows that one
// single-token panel spans go through register panels (one fused multiply-add per term, in row
// order, whatever the tile), wider rows through row tiles, for every m. A token's product is the
// same bits alone and among other tokens (moe_ffn_cpu.cc relies on it).
inline void MultiGemvAcc(const float* in, int64_t m, int64_t R, const float* W, int64_t ldw,
                         int64_t c0, int64_t c1, float* out, int64_t ldo, const void* next = nullptr,
                         int64_t next_bytes = 0) {
#if !defined(__AVX512F__)
  // Without AVX-512 every product, one token or several, narrow or wide rows, is chunked register
  // panels: the same arithmetic for every m, and faster than row tiles there for the expert and
  // dense shapes measured (docs/findings/2026-12-06-avx2-dense-panels.md).
  (void)next, (void)next_bytes;
  ChunkedPanelTiles(in, m, R, W, ldw, c0, c1, out, ldo);
#else
  const int64_t nv = (c1 - c0 + kVecLanes - 1) / kVecLanes;
  const int64_t block_bytes = R * (c1 - c0) * static_cast<int64_t>(sizeof(float));
  if (m >= 2 && block_bytes <= kCachedPanelBytes && nv <= MaxPanel<1>()) {
    const int64_t lead = std::min(WholeRowTokens(nv), std::min<int64_t>(m, kTileRows));
    TileOf(lead, in, R, W, ldw, c0, c1, out, ldo);
    if (m == lead) return;
    if (next != nullptr && next_bytes > 0 && block_bytes + next_bytes <= kCachedPanelBytes) {
      // The lines spread over the rows the cached tiles' panels read (W and the next block both
      // stay in L2).
      const int64_t tiles = (m - lead + kTileRows - 1) / kTileRows;
      const int64_t panels = (nv + MaxPanel<kTileRows>() - 1) / MaxPanel<kTileRows>();
      const int64_t rows = std::max<int64_t>(1, R * tiles * panels);
      Prefetch pf{static_cast<const char*>(next), static_cast<const char*>(next) + next_bytes,
                  (next_bytes / 64 + rows - 1) / rows};
      PanelTiles<kTileRows, true>(in + lead * R, m - lead, R, W, ldw, c0, c1, out + lead * ldo, ldo, &pf);
    } else {
      PanelTiles<kTileRows>(in + lead * R, m - lead, R, W, ldw, c0, c1, out + lead * ldo, ldo);
    }
  } else if (m >= 4 && nv <= MaxPanel<4>()) {
    PanelTiles<4>(in, m, R, W, ldw, c0, c1, out, ldo);
  } else if (m >= 3 && nv <= MaxPanel<3>()) {
    PanelTiles<3>(in, m, R, W, ldw, c0, c1, out, ldo);
  } else if (m >= 2 && nv <= MaxPanel<2>()) {
    PanelTiles<2>(in, m, R, W, ldw, c0, c1, out, ldo);
  } else if (nv <= MaxPanel<1>()) {
    PanelTiles<1>(in, m, R, W, ldw, c0, c1, out, ldo);
  } else {
    RowTileGemvAcc(in, m, R, W, ldw, c0, c1, out, ldo);
  }
#endif
}

// out[j, c0:c1] += sum_r in[j, r] * W[r, c0:c1] in register panels only: every output element
// accumulates its r terms in order, one multiply-add each, so a row's result does not depend on
// m (a plain step and a verification pass compute the same bits for the same row). For W that
// stays in cache (attention against one cache entry's keys and values).
inline void PanelGemvAcc(const float* in, int64_t m, int64_t R, const float* W, int64_t ldw,
                         int64_t c0, int64_t c1, float* out, int64_t ldo) {
  if (m >= 4) {
    PanelTiles<4>(in, m, R, W, ldw, c0, c1, out, ldo);
  } else {
    PanelTiles<1>(in, m, R, W, ldw, c0, c1, out, ldo);
  }
}

// The machine's cores, read once: std::thread::hardware_concurrency() reads
// /sys/devices/system/cpu/online on each call with glibc 2.36 (7.6 us, about as long as a whole
// 256 x 32 product), and every kernel call asks.
inline int Cores() {
  static const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return cores;
}

// Threads a kernel's work is split over: the caller and XLA's intra-op pool, at most the cores
// ($MOESPEC_FFI_THREADS overrides; read on every call, so a test may change it).
inline int ThreadsWanted(int64_t pool_threads) {
  int n = Cores();
  if (pool_threads > 0) n = std::min<int>(n, static_cast<int>(pool_threads) + 1);
  if (const char* env = std::getenv("MOESPEC_FFI_THREADS")) n = std::atoi(env);
  return std::max(1, n);
}

}  // namespace moespec

#endif  // MOESPEC_CSRC_GEMV_H_
