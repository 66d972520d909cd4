// The XLA FFI handler for CPU: jbps_psum's custom call target.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jbps {

// XLA_FFI_Handler for platform "cpu"; registered from Python with
// jax.ffi.register_ffi_target("jbps_psum", <capsule>, platform="cpu").
extern "C" XLA_FFI_Error* JbpsPsumCpu(XLA_FFI_CallFrame* call_frame);
// "jbps_join": releases the sums of a bucketed psum together (ffi_cpu.cc).
extern "C" XLA_FFI_Error* JbpsJoinCpu(XLA_FFI_CallFrame* call_frame);
// "jbps_workers": the running job's worker count, read when the program runs.
extern "C" XLA_FFI_Error* JbpsWorkersCpu(XLA_FFI_CallFrame* call_frame);

}  // namespace jbps
