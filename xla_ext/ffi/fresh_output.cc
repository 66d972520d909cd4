#include "ffi/fresh_output.h"

#include <sys/mman.h>

#include <cstdint>

namespace jbps {
namespace {

constexpr uintptr_t kHugePageBytes = uintptr_t{2} << 20;

}  // namespace

void PrepareFreshOutput(void* out, size_t nbytes) {
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(out) + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(out) + nbytes) & ~(kHugePageBytes - 1);
  if (end <= begin) return;
  // Best effort: where transparent huge pages are unavailable, 4 KiB pages as before.
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace jbps
