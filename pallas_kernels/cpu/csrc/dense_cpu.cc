// Dense product y [M, N * C] = x [M, D] @ W for CPU, called from JAX through the XLA FFI: the
// output head of decoding passes (a few rows against a wide [D, V] weight), the dense
// projections; and G such products side by side (x [G, M, D], W [G, N, D, C]: MLA's per-head
// up-projections).
//
// Why C++: XLA:CPU's dot reads a [D, V] head in short strided pieces (a 32 KB row stride), which
// streamed at a third of the rate of one contiguous read when the head is not in cache, as in a
// decode step. Here W is packed once, column block after column block, [N, D, C] (each block one
// contiguous [D, C] matrix, like an expert's weights), and each block is streamed once, row after
// row, for all M rows of x together (gemv.h).
//
// Work split: contiguous ranges of blocks (all G products' blocks), one per slot (slots.h). Each
// slot writes its own columns of y, so the result does not depend on which thread ran what, and
// each row's arithmetic does not depend on M.

#include <algorithm>
#include <cstdint>

#include "gemv.h"
#include "slots.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  // One product x [M, D] @ W [N, D, C], or G of them side by side: x [G, M, D], W [G, N, D, C].
  const bool grouped = xd.size() == 3;
  if (!((xd.size() == 2 && wd.size() == 3) || (grouped && wd.size() == 4 && wd[0] == xd[0])) ||
      wd[wd.size() - 2] != xd[xd.size() - 1]) {
    return ffi::Error::InvalidArgument("dense_cpu: expected x [M, D] and W [N, D, C], or x [G, M, D] and W [G, N, D, C]");
  }
  const int64_t G = grouped ? xd[0] : 1;
  const int64_t M = xd[xd.size() - 2], D = xd[xd.size() - 1];
  const int64_t N = wd[wd.size() - 3], C = wd[wd.size() - 1];
  if (yd.size() != xd.size() || yd[yd.size() - 2] != M || yd[yd.size() - 1] != N * C || (grouped && yd[0] != G)) {
    return ffi::Error::InvalidArgument("dense_cpu: expected y [M, N * C] (or [G, M, N * C])");
  }
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  if (M == 0 || N == 0 || G == 0) return ffi::Error::Success();
  const int64_t blocks = G * N;
  const int n_slots = moespec::SlotsFor(pool, blocks);
  const int64_t block_bytes = D * C * static_cast<int64_t>(sizeof(float));
  moespec::RunSlots(pool, n_slots, [&](int s) {
    const int64_t end = blocks * (s + 1) / n_slots;
    for (int64_t gb = blocks * s / n_slots; gb < end; ++gb) {
      const int64_t g = gb / N, b = gb % N;
      float* out = yp + g * M * N * C + b * C;
      for (int64_t j = 0; j < M; ++j) std::fill(out + j * N * C, out + j * N * C + C, 0.0f);
      // The slot's next block is prefetched while this one's later row tiles compute from cache.
      moespec::MultiGemvAcc(xp + g * M * D, M, D, wp + gb * D * C, C, 0, C, out, N * C,
                            gb + 1 < end ? wp + (gb + 1) * D * C : nullptr, block_bytes);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoespecDenseF32, DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
