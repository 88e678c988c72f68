// Dense product y [M, N * C] = x [M, D] @ W for CPU, called from JAX through the XLA FFI: the
// output head of decoding passes (a few rows against a wide [D, V] weight).
//
// Why C++: XLA:CPU's dot reads a [D, V] head in short strided pieces (a 32 KB row stride), which
// streamed at a third of the rate of one contiguous read when the head is not in cache, as in a
// decode step. Here W is packed once, column block after column block, [N, D, C] (each block one
// contiguous [D, C] matrix, like an expert's weights), and each block is streamed once, row after
// row, for all M rows of x together (gemv.h).
//
// Work split: contiguous ranges of blocks, one per slot; slots are claimed from an atomic
// counter by the caller and by tasks on XLA's intra-op thread pool (the call completes even if
// no pool thread picks a task up). Each slot writes its own columns of y, so the result does not
// depend on which thread ran what, and each row's arithmetic does not depend on M.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "gemv.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct DenseShared {
  std::atomic<int> next_slot{0};
  std::atomic<int> slots_done{0};
  const float* x = nullptr;
  const float* w = nullptr;
  float* y = nullptr;
  int64_t M = 0, D = 0, N = 0, C = 0;
  int n_slots = 1;

  void Work() {
    for (;;) {
      const int s = next_slot.fetch_add(1);
      if (s >= n_slots) return;
      const int64_t b0 = N * s / n_slots, b1 = N * (s + 1) / n_slots;
      for (int64_t b = b0; b < b1; ++b) {
        float* out = y + b * C;
        for (int64_t j = 0; j < M; ++j) std::fill(out + j * N * C, out + j * N * C + C, 0.0f);
        moespec::MultiGemvAcc(x, M, D, w + b * D * C, C, 0, C, out, N * C);
      }
      slots_done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1]) {
    return ffi::Error::InvalidArgument("dense_cpu: expected x [M, D] and W [N, D, C]");
  }
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0] * wd[2]) {
    return ffi::Error::InvalidArgument("dense_cpu: expected y [M, N * C]");
  }
  auto sh = std::make_shared<DenseShared>();
  sh->x = x.typed_data();
  sh->w = w.typed_data();
  sh->y = y->typed_data();
  sh->M = xd[0];
  sh->D = xd[1];
  sh->N = wd[0];
  sh->C = wd[2];
  if (sh->M == 0 || sh->N == 0) return ffi::Error::Success();
  sh->n_slots = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(moespec::ThreadsWanted(pool.num_threads()), sh->N)));
  for (int s = 1; s < sh->n_slots; ++s) pool.Schedule([sh]() { sh->Work(); });
  sh->Work();
  // Every slot is claimed by a running thread; a pool task that starts later finds none left.
  while (sh->slots_done.load(std::memory_order_acquire) < sh->n_slots) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoespecDenseF32, DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
