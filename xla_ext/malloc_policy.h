// The worker's malloc policy (JBPS_REUSE_FREED_MEMORY): freed memory stays in
// the process for the next allocation instead of going back to the kernel.
//
// XLA gives a psum whose input stays alive a fresh output buffer every call.
// glibc serves a large block with its own mmap and unmaps it when freed, so
// every call's output is new memory whose pages fault in on first touch: for
// 64 MiB that costs as much as the psum itself. With one arena, no mmap for
// large blocks and the heap's top trimmed only past kTrimThresholdBytes, the
// freed output of the last call is the next call's output, pages already there.
#pragma once

#include <string>

namespace jbps {

// Free memory at the top of the heap beyond which glibc still gives it back.
constexpr int kTrimThresholdBytes = 1 << 30;

// Applies the policy to this process (glibc mallopt). Threads pick their
// arena at their first allocation, so it takes full effect when applied
// before the process's other threads allocate. False, with *why, where it
// cannot be applied (not glibc, or mallopt refused).
bool KeepFreedMemory(std::string* why);

}  // namespace jbps
