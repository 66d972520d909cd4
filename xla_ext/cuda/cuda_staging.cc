#include "cuda/cuda_staging.h"

#include <cuda_runtime.h>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace jbps {
namespace {

// Sizes are rounded up so that tensors of nearly the same size share buffers.
constexpr size_t kGranule = 4096;
constexpr size_t kWordsPerSlab = 4096;

size_t Rounded(size_t bytes) { return (bytes + kGranule - 1) / kGranule * kGranule; }

std::string CudaError(const char* what, cudaError_t rc) {
  return std::string("jbps: ") + what + " failed: " + cudaGetErrorString(rc);
}

struct Pools {
  std::mutex mu;
  std::unordered_map<size_t, std::vector<void*>> free_buffers;  // by rounded size
  std::vector<volatile uint32_t*> free_words;
};

// Never destroyed: host functions may still return buffers at interpreter exit.
Pools& P() {
  static Pools* pools = new Pools;
  return *pools;
}

}  // namespace

void* AcquireStaging(size_t bytes, std::string* err) {
  const size_t size = Rounded(bytes == 0 ? 1 : bytes);
  {
    std::lock_guard<std::mutex> lock(P().mu);
    auto& list = P().free_buffers[size];
    if (!list.empty()) {
      void* b = list.back();
      list.pop_back();
      return b;
    }
  }
  void* b = nullptr;
  // Portable: the buffer serves streams of every device in the process.
  cudaError_t rc = cudaHostAlloc(&b, size, cudaHostAllocPortable);
  if (rc != cudaSuccess) {
    *err = CudaError(("cudaHostAlloc of " + std::to_string(size) + " staging bytes").c_str(), rc);
    return nullptr;
  }
  return b;
}

void ReleaseStaging(void* buffer, size_t bytes) {
  if (buffer == nullptr) return;
  std::lock_guard<std::mutex> lock(P().mu);
  P().free_buffers[Rounded(bytes == 0 ? 1 : bytes)].push_back(buffer);
}

bool AcquireCompletionWord(CompletionWord* out, std::string* err) {
  volatile uint32_t* word = nullptr;
  {
    std::lock_guard<std::mutex> lock(P().mu);
    if (!P().free_words.empty()) {
      word = P().free_words.back();
      P().free_words.pop_back();
    }
  }
  if (word == nullptr) {
    void* slab = nullptr;
    cudaError_t rc =
        cudaHostAlloc(&slab, kWordsPerSlab * sizeof(uint32_t), cudaHostAllocPortable | cudaHostAllocMapped);
    if (rc != cudaSuccess) {
      *err = CudaError("cudaHostAlloc of completion words", rc);
      return false;
    }
    auto* words = static_cast<volatile uint32_t*>(slab);
    std::lock_guard<std::mutex> lock(P().mu);
    for (size_t i = 1; i < kWordsPerSlab; ++i) P().free_words.push_back(words + i);
    word = words;
  }
  // Nothing else touches a free word: its last stream wait has passed and its
  // last writer has finished before it was released.
  *word = 0;
  void* device = nullptr;
  cudaError_t rc = cudaHostGetDevicePointer(&device, const_cast<uint32_t*>(word), 0);
  if (rc != cudaSuccess) {
    ReleaseCompletionWord({word, 0});
    *err = CudaError("cudaHostGetDevicePointer of a completion word", rc);
    return false;
  }
  out->host = word;
  out->device = reinterpret_cast<uint64_t>(device);
  return true;
}

void ReleaseCompletionWord(const CompletionWord& word) {
  if (word.host == nullptr) return;
  std::lock_guard<std::mutex> lock(P().mu);
  P().free_words.push_back(word.host);
}

}  // namespace jbps
