// A heap buffer aligned for vector loads and page-friendly DMA.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

namespace jbps {

class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t size) : size_(size) {
    // Page alignment for large buffers (kernel copies), cache-line otherwise.
    size_t align = size >= 65536 ? 4096 : 64;
    if (size == 0) return;
    if (posix_memalign(&data_, align, size) != 0) throw std::bad_alloc();
  }
  ~AlignedBuffer() { std::free(data_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  char* data() { return static_cast<char*>(data_); }
  const char* data() const { return static_cast<const char*>(data_); }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_;
};

}  // namespace jbps
