// A stream-ordered wait on a host-written word: the stream stops at this point
// until the word equals the value, without any host thread blocking. Uses the
// driver's cuStreamWaitValue32, looked up through the runtime
// (cudaGetDriverEntryPoint*), so the module never links against libcuda.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace jbps {

// False when the driver offers no cuStreamWaitValue32 (then *why says so) or
// JBPS_CUDA_HOST_WAIT=1 asks for the host-function fallback.
bool StreamWaitAvailable(std::string* why);

// Enqueues "wait until *device_word == value" on `stream`. False (with *err)
// when the driver refuses, e.g. stream memory operations unsupported.
bool EnqueueStreamWait(cudaStream_t stream, uint64_t device_word, uint32_t value, std::string* err);

}  // namespace jbps
