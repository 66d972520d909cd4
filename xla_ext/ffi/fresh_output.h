// A psum whose operand is a parameter the caller keeps sums into a fresh
// output buffer (jbps/ops/kept_operands.py), new memory every call: XLA's
// allocator maps large buffers anew, and each page faults in on its first
// touch, which for 64 MiB costs as much as the psum. Huge pages cut the
// faults 512-fold (32 instead of 16,384 for 64 MiB); what remains is the
// kernel zeroing the pages.
#pragma once

#include <cstddef>

namespace jbps {

// Asks the kernel to back the whole 2 MiB pages of [out, out + nbytes) with
// huge pages (madvise MADV_HUGEPAGE; where transparent huge pages are off,
// the kernel ignores it). Call before the buffer is first touched.
void PrepareFreshOutput(void* out, size_t nbytes);

}  // namespace jbps
