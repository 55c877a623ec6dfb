// Runs independent pieces of a conversion on the host's cores: converting a large checkpoint (hundreds
// of GB) is otherwise one core's work for tens of minutes. Each index is handled exactly once, by one
// thread, so results that write disjoint outputs are the same bits whatever the thread count.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace moe::detail {

// fn(i) for every i in [0, n), on up to hardware_concurrency() threads (the calling one included). The
// first exception thrown by any fn is rethrown here once every thread has stopped.
template <class Fn>
void parallel_for(size_t n, Fn&& fn) {
  const size_t threads = std::min<size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  if (threads <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    for (size_t i = next++; i < n; i = next++) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        next = n;  // the others stop at their next index
      }
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace moe::detail
