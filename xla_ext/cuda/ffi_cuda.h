// The XLA FFI handler for CUDA: jbps_psum's custom call target on GPUs.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jbps {

// XLA_FFI_Handler for platform "CUDA"; registered from Python with
// jax.ffi.register_ffi_target("jbps_psum", <capsule>, platform="CUDA").
extern "C" XLA_FFI_Error* JbpsPsumCuda(XLA_FFI_CallFrame* call_frame);
// "jbps_join" for CUDA: as on CPU, a device copy only where a result is not its operand.
extern "C" XLA_FFI_Error* JbpsJoinCuda(XLA_FFI_CallFrame* call_frame);

// The engine's psum timeout (jbps.init's timeout_s): bounds the waits the
// handler itself makes (JBPS_CUDA_SYNC=1, the host-function fallback).
void SetCudaWaitTimeout(double seconds);

}  // namespace jbps
