#include "cuda/cuda_stream_wait.h"

#include <cuda.h>

#include <cstdlib>
#include <mutex>

namespace jbps {
namespace {

using WaitValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct Lookup {
  WaitValue32Fn fn = nullptr;
  std::string why;
};

const Lookup& Resolve() {
  static Lookup lookup;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("JBPS_CUDA_HOST_WAIT");
    if (env != nullptr && std::string(env) == "1") {
      lookup.why = "JBPS_CUDA_HOST_WAIT=1";
      return;
    }
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    // 12000: the cuStreamWaitValue32 of CUDA 12 (the _v2 entry point, always
    // enabled), not the CUDA 8 one that needed a driver option.
#if CUDART_VERSION >= 12050
    cudaError_t rc = cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault, &status);
#else
    cudaError_t rc = cudaGetDriverEntryPoint("cuStreamWaitValue32", &fn, cudaEnableDefault, &status);
#endif
    if (rc != cudaSuccess || status != cudaDriverEntryPointSuccess || fn == nullptr) {
      lookup.why = std::string("the CUDA driver has no cuStreamWaitValue32 (") + cudaGetErrorString(rc) + ")";
      return;
    }
    lookup.fn = reinterpret_cast<WaitValue32Fn>(fn);
  });
  return lookup;
}

}  // namespace

bool StreamWaitAvailable(std::string* why) {
  const Lookup& l = Resolve();
  if (l.fn == nullptr) *why = l.why;
  return l.fn != nullptr;
}

bool EnqueueStreamWait(cudaStream_t stream, uint64_t device_word, uint32_t value, std::string* err) {
  const Lookup& l = Resolve();
  if (l.fn == nullptr) {
    *err = l.why;
    return false;
  }
  CUresult rc =
      l.fn(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(device_word), value, CU_STREAM_WAIT_VALUE_EQ);
  if (rc != CUDA_SUCCESS) {
    *err = "cuStreamWaitValue32 failed with CUresult " + std::to_string(static_cast<int>(rc));
    return false;
  }
  return true;
}

}  // namespace jbps
