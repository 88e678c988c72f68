// Fork-join over a few slots of work for the C++ CPU kernels, on XLA's intra-op thread pool.

#ifndef MOESPEC_CSRC_SLOTS_H_
#define MOESPEC_CSRC_SLOTS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "gemv.h"
#include "xla/ffi/api/ffi.h"

namespace moespec {

// Slots for n_work independent pieces: one per thread (ThreadsWanted), at most n_work, at least 1.
inline int SlotsFor(xla::ffi::ThreadPool& pool, int64_t n_work) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ThreadsWanted(pool.num_threads()), n_work)));
}

// Runs run_slot(s) for every s < n_slots and returns when all have run. Slots are claimed from an
// atomic counter by the caller and by tasks on the pool, so the call completes even if no pool
// thread ever picks a task up; a task that starts after the call returned finds no slot left and
// never calls run_slot. What a slot computes must not depend on which thread runs it.
inline void RunSlots(xla::ffi::ThreadPool& pool, int n_slots, std::function<void(int)> run_slot) {
  struct State {
    std::atomic<int> next{0};
    std::atomic<int> done{0};
    int n = 0;
    std::function<void(int)> run;
    void Work() {
      for (int s = next.fetch_add(1); s < n; s = next.fetch_add(1)) {
        run(s);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>();
  state->n = n_slots;
  state->run = std::move(run_slot);
  for (int s = 1; s < n_slots; ++s) pool.Schedule([state]() { state->Work(); });
  state->Work();
  // Every slot is claimed by a running thread; wait for the ones still running.
  while (state->done.load(std::memory_order_acquire) < n_slots) std::this_thread::yield();
}

}  // namespace moespec

#endif  // MOESPEC_CSRC_SLOTS_H_
