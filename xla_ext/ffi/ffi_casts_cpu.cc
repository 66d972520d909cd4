// The casts around a psum with compression="fp16" or "bf16" on XLA:CPU, with
// the servers' own conversions (sum_kernels.h): one thread, vectorized, in
// the calling XLA thread. XLA's own convert splits a large cast over its
// thread pool; where the workers' pools share cores (CPU-only hosts running
// several processes, the emulated cluster), a 32 MiB cast then took 3-15 ms
// median and up to 34 ms (4 processes on 2 cores), and 4 workers entered a
// psum up to 46 ms apart, which every worker waits out. One thread took
// 2.3-3.1 ms median the same way. On GPUs the casts stay XLA ops.
//
// Rounding is to nearest even, as XLA's convert and numpy's; a float32 NaN
// stays a NaN (bfloat16: quiet).
#include "ffi/ffi_casts_cpu.h"

#include <string>

#include "engine/engine.h"
#include "ffi/ffi_operand.h"
#include "ffi/fresh_output.h"
#include "kernels/sum_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jbps {
namespace {

// The 16-bit float type of `t` (dtype.h's mapping), or an error naming `what`.
ffi::Error HalfType(const char* what, ffi::DataType t, DType* out) {
  if (ToDType(t, out) && (*out == DType::kF16 || *out == DType::kBF16)) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string(what) + ": the 16-bit side must be float16 or bfloat16");
}

ffi::Error SameCount(const char* what, size_t a, size_t b) {
  if (a == b) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string(what) + ": " + std::to_string(a) + " values in, " + std::to_string(b) + " out");
}

ffi::Error NarrowCpu(ffi::Buffer<ffi::F32> values, ffi::Result<ffi::AnyBuffer> narrowed) {
  DType half;
  if (ffi::Error e = HalfType("jbps_narrow", narrowed->element_type(), &half); e.failure()) return e;
  if (ffi::Error e = SameCount("jbps_narrow", values.element_count(), narrowed->element_count()); e.failure()) return e;
  AccumulatorFinish(half, 0, narrowed->untyped_data(), values.typed_data(), values.element_count());
  return ffi::Error::Success();
}

ffi::Error WidenCpu(ffi::AnyBuffer narrowed, ffi::Result<ffi::Buffer<ffi::F32>> values) {
  DType half;
  if (ffi::Error e = HalfType("jbps_widen", narrowed.element_type(), &half); e.failure()) return e;
  if (ffi::Error e = SameCount("jbps_widen", narrowed.element_count(), values->element_count()); e.failure()) return e;
  // Usually a fresh buffer: huge pages fault it in fewer times (fresh_output.h).
  if (Engine::Get().huge_pages()) PrepareFreshOutput(values->typed_data(), values->size_bytes());
  AccumulatorInit(half, 0, values->typed_data(), narrowed.untyped_data(), narrowed.element_count());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbpsNarrowCpu, NarrowCpu,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbpsWidenCpu, WidenCpu,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>());

}  // namespace jbps
