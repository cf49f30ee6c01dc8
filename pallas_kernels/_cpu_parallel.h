// Work sharing for the C++ CPU kernels: items claimed from a shared counter by the calling
// thread and XLA's CPU thread pool (no second pool competing with XLA's for the cores).
// The caller works too and then waits only for items already claimed, so it never waits
// on a task the pool has not started. Included by each kernel's cpu_kernel.cc;
// ``_cpu_build`` hashes this header with the kernel's source.

#ifndef JAXPAGE_CPU_PARALLEL_H_
#define JAXPAGE_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxpage {

// The items claimed so far and the items finished, shared by a call's workers.
struct Counters {
  std::atomic<int64_t> next{0}, done{0};
};

// Hand `work` to `helpers` pool tasks, run it on the calling thread too, then wait until
// `done` counts all n items (each task owns a copy of `work` and its shared state).
template <typename Work>
void RunShared(int64_t n, int64_t helpers, xla::ffi::ThreadPool& pool, const Work& work,
               const std::atomic<int64_t>& done) {
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  while (done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// Run body(i, next) for i in [0, n); `next` is the item the same worker does after i (-1:
// none), claimed ahead so that its data can be prefetched while i runs.
template <typename Body>
void ParallelForAhead(int64_t n, xla::ffi::ThreadPool& pool, Body body) {
  auto shared = std::make_shared<Counters>();
  auto work = [shared, n, body]() {
    int64_t item = shared->next.fetch_add(1);
    while (item < n) {
      const int64_t after = shared->next.fetch_add(1);
      body(item, after < n ? after : -1);
      shared->done.fetch_add(1, std::memory_order_release);
      item = after;
    }
  };
  RunShared(n, std::min<int64_t>(pool.num_threads(), (n + 1) / 2 - 1), pool, work, shared->done);
}

// Run body(i) for i in [0, n), one item at a time per worker.
template <typename Body>
void ParallelFor(int64_t n, xla::ffi::ThreadPool& pool, Body body) {
  auto shared = std::make_shared<Counters>();
  auto work = [shared, n, body]() {
    for (int64_t i = shared->next.fetch_add(1); i < n; i = shared->next.fetch_add(1)) {
      body(i);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  RunShared(n, std::min<int64_t>(pool.num_threads(), n - 1), pool, work, shared->done);
}

}  // namespace jaxpage

#endif  // JAXPAGE_CPU_PARALLEL_H_
