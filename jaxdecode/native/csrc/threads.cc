// The helper, a pool thread that stays on between calls, and Share, which hands it a call's task.
// The helper's state is global and lives here only.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#include "threads.h"

namespace jaxdecode {
namespace {

// The helper: one pool task that, after helping with a parallel call, waits for the next one (up
// to kStayAwake) and helps with that too, and so on. A decode pass calls a layer, then runs XLA's
// own operations on one thread for some microseconds (sampling; a speculative pass's acceptance
// test and draft) before the next layer. When each call schedules a new pool task, a pool thread
// that went to sleep in that gap can take tens of microseconds to wake on a virtual machine, while
// the calling thread does the layer's work alone: at batch 1 on two cores, the second thread of
// 3.8% of a speculative run's layer calls started 5-200 microseconds late. A task that only spun
// in the gap cut that to 1.0%, but then the next call's task could go to the other pool thread,
// asleep, and plain sampling's late starts went from 0.3-0.9% to 1.7-3.2%. With the helper, in
// the same process, batch-1 sampling ran 2-3% faster and speculative sampling 1-4% faster.
//
// A call hands its task to the helper when one is running, else schedules a task that becomes the
// helper. The hand-over is under a mutex; the helper polls a counter in between. There is at most
// one helper, so it never competes with the calling thread for a core.
struct Helper {
  std::mutex mu;
  std::shared_ptr<std::function<void()>> job;  // the latest call's task, until the helper takes it
  bool running = false;                         // a helper task is scheduled or running
  std::atomic<uint64_t> posted{0};              // tasks handed over so far
};
Helper& g_helper = *new Helper;  // never destroyed: a helper may outlive static destructors
constexpr auto kStayAwake = std::chrono::microseconds(50);

// `seen`: the hand-overs counted when this helper was scheduled; any later one is for it.
void HelperLoop(std::shared_ptr<std::function<void()>> task, uint64_t seen) {
  (*task)();
  auto until = std::chrono::steady_clock::now() + kStayAwake;
  for (int spins = 0;; ++spins) {
    if (g_helper.posted.load(std::memory_order_acquire) != seen) {
      {
        std::lock_guard<std::mutex> lock(g_helper.mu);
        seen = g_helper.posted.load(std::memory_order_relaxed);
        task = std::move(g_helper.job);
      }
      if (task) (*task)();
      until = std::chrono::steady_clock::now() + kStayAwake;
      continue;
    }
    Relax();
    if (spins % 64 == 63 && std::chrono::steady_clock::now() >= until) {
      std::lock_guard<std::mutex> lock(g_helper.mu);
      if (g_helper.posted.load(std::memory_order_relaxed) == seen) {  // nothing new: leave
        g_helper.running = false;
        g_helper.job.reset();
        return;
      }
    }
  }
}

}  // namespace

// Runs `fn` on one more thread: the helper's, or a new pool task that becomes the helper.
void Share(ffi::ThreadPool& pool, std::function<void()> fn) {
  auto task = std::make_shared<std::function<void()>>(std::move(fn));
  uint64_t seen;
  {
    std::lock_guard<std::mutex> lock(g_helper.mu);
    if (g_helper.running) {
      g_helper.job = task;
      g_helper.posted.fetch_add(1, std::memory_order_release);
      return;
    }
    g_helper.running = true;
    seen = g_helper.posted.load(std::memory_order_relaxed);
  }
  pool.Schedule([task, seen] { HelperLoop(task, seen); });
}

}  // namespace jaxdecode
