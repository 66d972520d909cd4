#include "malloc_policy.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace jbps {

bool KeepFreedMemory(std::string* why) {
#if defined(__GLIBC__)
  // One arena: every thread's large blocks come from the main heap, which
  // can hold them (a thread's own arena cannot hold a block over 64 MiB and
  // maps it anyway). No mmap: large blocks are reused like small ones.
  if (mallopt(M_ARENA_MAX, 1) != 1 || mallopt(M_MMAP_MAX, 0) != 1 ||
      mallopt(M_TRIM_THRESHOLD, kTrimThresholdBytes) != 1) {
    *why = "glibc's mallopt refused the setting";
    return false;
  }
  return true;
#else
  *why = "the C library is not glibc";
  return false;
#endif
}

}  // namespace jbps
