// Sharing one call's work between the calling thread and XLA's intra-op thread pool: the helper,
// a pool thread that stays on between calls (Share, defined in threads.cc), and the schedulers
// built on it (RunPhases, ParallelFor).

#ifndef JAXDECODE_CSRC_THREADS_H_
#define JAXDECODE_CSRC_THREADS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "common.h"

namespace jaxdecode {

// A moment's pause in a spin-wait.
static inline void Relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// Runs `fn` on one more thread: the helper's, or a new pool task that becomes the helper (see
// threads.cc). There is at most one helper, so it never competes with the calling thread for a core.
// Hidden: the library exports only its FFI handlers.
__attribute__((visibility("hidden"))) void Share(ffi::ThreadPool& pool, std::function<void()> fn);

// Runs the phases of `work` in order on the calling thread and up to `threads - 1` other threads
// (the helper and pool tasks). Counters live in a shared_ptr: a task that starts late finds every
// item taken and every phase done, and touches nothing else (work must capture by value).
template <typename W>
static void RunPhases(ffi::ThreadPool& pool, int64_t threads, const W& work) {
  constexpr int P = W::kPhases;
  struct Counters {
    std::atomic<int64_t> next[P], done[P];
    int64_t items[P];
  };
  auto c = std::make_shared<Counters>();
  for (int i = 0; i < P; ++i) c->next[i] = 0, c->done[i] = 0, c->items[i] = work.Items(i);
  auto run = [c, work] {
    for (int i = 0; i < P; ++i) {
      for (int64_t j; (j = c->next[i].fetch_add(1)) < c->items[i];) {
        work.Run(i, j);
        c->done[i].fetch_add(1, std::memory_order_release);
      }
      for (int spins = 0; c->done[i].load(std::memory_order_acquire) < c->items[i]; ++spins)
        if (spins < 4096) Relax(); else std::this_thread::yield();
    }
  };
  if (threads > 1) Share(pool, run);
  for (int64_t t = 2; t < threads; ++t) pool.Schedule([run] { run(); });
  run();
}

// A single phase of `items` work items, for RunPhases.
template <typename F>
struct OnePhase {
  static constexpr int kPhases = 1;
  F fn;
  int64_t items;
  int64_t Items(int) const { return items; }
  void Run(int, int64_t i) const { fn(i); }
};

// Runs fn(i) for every i in [0, items) on the calling thread and up to `threads - 1` pool tasks.
template <typename F>
static void ParallelFor(ffi::ThreadPool& pool, int64_t items, int64_t threads, F fn) {
  RunPhases(pool, std::min(threads, items), OnePhase<F>{fn, items});
}

}  // namespace jaxdecode

#endif  // JAXDECODE_CSRC_THREADS_H_
