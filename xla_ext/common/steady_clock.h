// Nanoseconds of CLOCK_MONOTONIC: the clock every process on a machine
// shares, and Python's time.perf_counter_ns() on Linux, so the latency
// breakdown lines up stamps of the engine, the servers and the caller.
#pragma once

#include <chrono>
#include <cstdint>

namespace jbps {

inline int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace jbps
