// A copy whose destination is not read again soon: XLA's output buffer,
// written from a shared-memory sum. Non-temporal stores skip reading each
// destination line into the cache first (a third of a plain copy's memory
// traffic) and leave the cache to the data still in flight.
#pragma once

#include <cstddef>

namespace jbps {

void StreamCopy(void* dst, const void* src, size_t n);

}  // namespace jbps
