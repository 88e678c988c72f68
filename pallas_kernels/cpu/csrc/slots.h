// Fork-join over a few slots of work for the C++ CPU kernels, on XLA's intra-op thread pool.

#ifndef MOESPEC_CSRC_SLOTS_H_
#define MOESPEC_CSRC_SLOTS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

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

// Runs run_range(u0, u1) over `units` (each with a `cost`, e.g. rows x keys read) dealt to slots
// (SlotsFor) as contiguous ranges of near-equal total cost: a unit goes to the slot in which the
// midpoint of its cost falls.
template <typename Unit, typename RunRange>
inline void RunByCost(xla::ffi::ThreadPool& pool, const std::vector<Unit>& units, RunRange run_range) {
  const int n_slots = SlotsFor(pool, static_cast<int64_t>(units.size()));
  std::vector<size_t> first(n_slots + 1, units.size());
  first[0] = 0;
  double total = 0.0;
  for (const Unit& unit : units) total += unit.cost;
  double done = 0.0;
  for (size_t u = 0, s = 1; u < units.size(); ++u) {
    done += units[u].cost;
    while (s < static_cast<size_t>(n_slots) && done - 0.5 * units[u].cost >= total * s / n_slots) first[s++] = u;
  }
  RunSlots(pool, n_slots, [&](int s) { run_range(first[s], first[s + 1]); });
}

}  // namespace moespec

#endif  // MOESPEC_CSRC_SLOTS_H_
