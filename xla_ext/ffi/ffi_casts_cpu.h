// The 16-bit float compressions' casts as XLA:CPU FFI handlers
// (ffi_casts_cpu.cc).
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jbps {

// "jbps_narrow": float32 values -> the same values as float16 or bfloat16
// (the result's dtype), rounded to nearest even as the servers round sums.
extern "C" XLA_FFI_Error* JbpsNarrowCpu(XLA_FFI_CallFrame* call_frame);
// "jbps_widen": float16 or bfloat16 values -> float32, exactly.
extern "C" XLA_FFI_Error* JbpsWidenCpu(XLA_FFI_CallFrame* call_frame);

}  // namespace jbps
