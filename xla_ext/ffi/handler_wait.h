// A small psum's sum is usually back within tens of microseconds: the FFI
// handler that submitted it waits that long itself, polling and then
// sleeping, so XLA goes on in the handler's own thread with no completion
// thread's hand-off and wake-up in between. A call not done by the end of
// the wait is left to the engine's completion thread as usual, so a slow
// peer holds an XLA thread for that wait at most.
#pragma once

#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

#include "common/steady_clock.h"

namespace jbps {

class HandlerWait {
 public:
  // From the engine thread that completes the call (Engine::Submit's early
  // callback): true when the handler is still waiting and takes the result.
  bool Offer(const std::string& error) {
    error_ = error;
    int expected = kWaiting;
    if (!state_.compare_exchange_strong(expected, kDone)) return false;
    {
      std::lock_guard<std::mutex> lock(mu_);
    }  // the waiter is in cv_.wait or has not checked yet
    cv_.notify_one();
    return true;
  }

  // Polls (yielding the CPU between polls) for up to spin_ns, then sleeps,
  // for up to wait_ns in all. True when the result came (see error());
  // false when the handler gave up and the completion thread takes it.
  bool Wait(int64_t spin_ns, int64_t wait_ns) {
    const int64_t start = SteadyNs();
    while (state_.load() == kWaiting && SteadyNs() - start < spin_ns) ::sched_yield();
    if (state_.load() == kWaiting) {
      std::unique_lock<std::mutex> lock(mu_);
      const int64_t left = wait_ns - (SteadyNs() - start);
      cv_.wait_for(lock, std::chrono::nanoseconds(left > 0 ? left : 0), [&] { return state_.load() != kWaiting; });
    }
    int expected = kWaiting;
    return !state_.compare_exchange_strong(expected, kGaveUp);
  }

  const std::string& error() const { return error_; }

 private:
  enum : int { kWaiting, kDone, kGaveUp };
  std::atomic<int> state_{kWaiting};
  std::string error_;
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace jbps
