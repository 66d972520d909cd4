// Pinned host memory for the CUDA handler: staging buffers that shards are
// copied into and sums are copied out of, and completion words the device can
// read. Both are allocated once and reused across calls, because
// cudaHostAlloc is slow (it pins pages) and cudaFreeHost synchronises the
// whole device, which would stall every stream of the step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace jbps {

// A pinned buffer of at least `bytes`; nullptr (with *err set) when CUDA
// cannot allocate it. Call from a normal thread, never from a CUDA host
// function (no CUDA calls are allowed there).
void* AcquireStaging(size_t bytes, std::string* err);
// Returns a buffer from AcquireStaging. No CUDA calls: safe in a host function.
void ReleaseStaging(void* buffer, size_t bytes);

// A word of pinned, device-mapped host memory, reset to 0: the host writes 1
// when an engine call is done and a stream waits for that value.
struct CompletionWord {
  volatile uint32_t* host = nullptr;
  uint64_t device = 0;  // the same word's device address (a CUdeviceptr)
};
bool AcquireCompletionWord(CompletionWord* out, std::string* err);
// No CUDA calls: safe in a host function.
void ReleaseCompletionWord(const CompletionWord& word);

}  // namespace jbps
