#include "cuda/cuda_copy_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

namespace jbps {
namespace {

bool Check(cudaError_t rc, const char* what, std::string* err) {
  if (rc == cudaSuccess) return true;
  *err = std::string("jbps: ") + what + " failed: " + cudaGetErrorString(rc);
  return false;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

bool TimePinnedCopies(size_t bytes, int iters, CopyTimes* out, std::string* err) {
  void* dev = nullptr;
  void* host = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::vector<double> d2h, h2d;
  bool ok = Check(cudaMalloc(&dev, bytes), "cudaMalloc", err) &&
            Check(cudaHostAlloc(&host, bytes, cudaHostAllocPortable), "cudaHostAlloc", err) &&
            Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate", err) &&
            Check(cudaEventCreate(&start), "cudaEventCreate", err) &&
            Check(cudaEventCreate(&stop), "cudaEventCreate", err);
  for (int i = 0; ok && i < std::max(iters, 1) * 2; ++i) {
    const bool to_host = i % 2 == 0;
    float ms = 0;
    ok = Check(cudaEventRecord(start, stream), "cudaEventRecord", err) &&
         Check(cudaMemcpyAsync(to_host ? host : dev, to_host ? dev : host, bytes,
                               to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync", err) &&
         Check(cudaEventRecord(stop, stream), "cudaEventRecord", err) &&
         Check(cudaEventSynchronize(stop), "cudaEventSynchronize", err) &&
         Check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime", err);
    (to_host ? d2h : h2d).push_back(ms / 1000.0);
  }
  if (ok) {
    out->d2h_seconds = Median(d2h);
    out->h2d_seconds = Median(h2d);
  }
  if (start) cudaEventDestroy(start);
  if (stop) cudaEventDestroy(stop);
  if (stream) cudaStreamDestroy(stream);
  if (host) cudaFreeHost(host);
  if (dev) cudaFree(dev);
  return ok;
}

}  // namespace jbps
