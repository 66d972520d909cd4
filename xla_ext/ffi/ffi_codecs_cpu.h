// The workers' onebit and top-k encoders and decoders as XLA:CPU FFI
// handlers (ffi_codecs_cpu.cc).
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jbps {

// "jbps_topk_encode": float32 values -> (uint32 records, float32 values left).
extern "C" XLA_FFI_Error* JbpsTopKEncodeCpu(XLA_FFI_CallFrame* call_frame);
// "jbps_topk_decode": uint32 records -> float32 values.
extern "C" XLA_FFI_Error* JbpsTopKDecodeCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbpsTopKDecodeIntoCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbpsTopKEncodeAddedCpu(XLA_FFI_CallFrame* call_frame);
// "jbps_onebit_encode": float32 values, int32 counts -> (uint8 records, float32 values left).
extern "C" XLA_FFI_Error* JbpsOneBitEncodeCpu(XLA_FFI_CallFrame* call_frame);
// "jbps_onebit_decode": uint8 records -> float32 values.
extern "C" XLA_FFI_Error* JbpsOneBitDecodeCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbpsOneBitDecodeIntoCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JbpsOneBitEncodeAddedCpu(XLA_FFI_CallFrame* call_frame);

}  // namespace jbps
