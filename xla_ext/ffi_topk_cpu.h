// The workers' top-k encode and decode as XLA:CPU FFI handlers (ffi_topk_cpu.cc).
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jbps {

// "jbps_topk_encode": float32 values -> (uint32 records, float32 sent).
extern "C" XLA_FFI_Error* JbpsTopKEncodeCpu(XLA_FFI_CallFrame* call_frame);
// "jbps_topk_decode": uint32 records -> float32 values.
extern "C" XLA_FFI_Error* JbpsTopKDecodeCpu(XLA_FFI_CallFrame* call_frame);

}  // namespace jbps
