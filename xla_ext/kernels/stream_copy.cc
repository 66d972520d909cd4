#include "kernels/stream_copy.h"

#include <cstdint>
#include <cstring>

#include "kernels/multiversion.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define JBPS_STREAM_X86 1
#endif

namespace jbps {
namespace {

// Below this, a plain copy: the stores' fence and the head and tail cost more
// than they save, and small destinations are likely read again soon.
constexpr size_t kStreamMinBytes = 256 * 1024;

#ifdef JBPS_STREAM_X86
__attribute__((target("avx2"))) void StreamCopyAvx2(char* dst, const char* src, size_t n) {
  // Head up to a 32-byte aligned destination, then whole vectors, then the tail.
  size_t head = (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  _mm_sfence();  // streamed stores are weakly ordered: visible before the sum is declared done
  std::memcpy(dst + i, src + i, n - i);
}
#endif

}  // namespace

void StreamCopy(void* dst, const void* src, size_t n) {
#ifdef JBPS_STREAM_X86
  if (CpuHasAvx2() && n >= kStreamMinBytes) {
    StreamCopyAvx2(static_cast<char*>(dst), static_cast<const char*>(src), n);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace jbps
