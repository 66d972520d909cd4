// The yardstick for the CUDA handler's staging: plain cudaMemcpyAsync between
// a device buffer and pinned host memory, timed with CUDA events, for the
// benchmark (jbps/bench/cuda_staging.py) to compare the handler against.
#pragma once

#include <cstddef>
#include <string>

namespace jbps {

struct CopyTimes {
  double d2h_seconds = 0;  // median of `iters` copies of `bytes`
  double h2d_seconds = 0;
};

// On the current device; false with *err naming the CUDA call that failed.
bool TimePinnedCopies(size_t bytes, int iters, CopyTimes* out, std::string* err);

}  // namespace jbps
