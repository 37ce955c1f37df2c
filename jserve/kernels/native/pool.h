// Work items spread over XLA's intra-op thread pool, for the native CPU kernels.
//
// The calling thread and up to num_threads - 1 tasks take items from one counter. The caller
// waits only for items that were taken, never for a task to start: on a busy pool (another
// device's program on the same threads) it does every item itself, so two programs sharing
// the pool cannot deadlock. The shared state outlives the call, so a task that starts late
// finds nothing to do and touches no buffer.
#ifndef JSERVE_KERNELS_NATIVE_POOL_H_
#define JSERVE_KERNELS_NATIVE_POOL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jserve_native {

struct Items {
  Items(int64_t n, std::function<void(int64_t)> f) : items(n), run(std::move(f)) {}
  int64_t items;
  std::function<void(int64_t)> run;
  std::atomic<int64_t> next{0};
  int64_t finished = 0;  // guarded by mu
  std::mutex mu;
  std::condition_variable all_done;

  void work() {
    int64_t mine = 0;
    for (int64_t i; (i = next.fetch_add(1)) < items; ++mine) run(i);
    if (mine == 0) return;
    std::lock_guard<std::mutex> lock(mu);
    finished += mine;
    if (finished == items) all_done.notify_all();
  }
};

// Runs f(i) for every i in [0, n); f must stay valid only until this returns (late tasks
// take no item, so never call it).
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t)> f) {
  if (n <= 0) return;
  auto shared = std::make_shared<Items>(n, std::move(f));
  const int64_t helpers = std::max<int64_t>(0, std::min<int64_t>(pool.num_threads(), n) - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([shared]() { shared->work(); });
  shared->work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->all_done.wait(lock, [&] { return shared->finished == shared->items; });
}

}  // namespace jserve_native

#endif  // JSERVE_KERNELS_NATIVE_POOL_H_
