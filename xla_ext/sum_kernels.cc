// Plain loops over restrict pointers, compiled for three instruction sets at
// once (target_clones: baseline x86-64, Haswell AVX2+F16C, Skylake AVX-512) and
// picked at load time by the CPU's features. Checked with objdump on GCC 12
// -O3: the float32/float64/int32 adds and the bfloat16 loops vectorise
// (vaddps/vaddpd/vpaddd on ymm; zmm in the AVX-512 bfloat16 clone). The float16
// loops do not yet: they convert one element at a time (scalar vcvtph2ps).
#include "sum_kernels.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JBPS_MULTIVERSION \
  __attribute__((target_clones("default", "arch=haswell", "arch=skylake-avx512")))
#else
#define JBPS_MULTIVERSION
#endif

namespace jbps {
namespace {

// bfloat16 is the upper half of a float32.
inline float Bf16ToF32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

JBPS_MULTIVERSION void AddF32(float* __restrict acc, const float* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += src[i];
}

JBPS_MULTIVERSION void AddF64(double* __restrict acc, const double* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += src[i];
}

JBPS_MULTIVERSION void AddI32(uint32_t* __restrict acc, const uint32_t* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += src[i];  // unsigned: wraps, no UB
}

JBPS_MULTIVERSION void SumF32(float* __restrict acc, const float* __restrict a, const float* __restrict b, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = a[i] + b[i];
}

JBPS_MULTIVERSION void SumF64(double* __restrict acc, const double* __restrict a, const double* __restrict b,
                              size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = a[i] + b[i];
}

JBPS_MULTIVERSION void SumI32(uint32_t* __restrict acc, const uint32_t* __restrict a, const uint32_t* __restrict b,
                              size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = a[i] + b[i];
}

JBPS_MULTIVERSION void InitBf16(float* __restrict acc, const uint16_t* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = Bf16ToF32(src[i]);
}

JBPS_MULTIVERSION void AddBf16(float* __restrict acc, const uint16_t* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += Bf16ToF32(src[i]);
}

JBPS_MULTIVERSION void FinishBf16(uint16_t* __restrict dst, const float* __restrict acc, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F32ToBf16(acc[i]);
}

JBPS_MULTIVERSION void InitF16(float* __restrict acc, const _Float16* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = static_cast<float>(src[i]);
}

JBPS_MULTIVERSION void AddF16(float* __restrict acc, const _Float16* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += static_cast<float>(src[i]);
}

JBPS_MULTIVERSION void FinishF16(_Float16* __restrict dst, const float* __restrict acc, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<_Float16>(acc[i]);
}

}  // namespace

void AccumulatorInit(DType d, void* acc, const void* src, size_t count) {
  switch (d) {
    case DType::kF32:
    case DType::kF64:
    case DType::kI32:
      std::memcpy(acc, src, count * DTypeSize(d));
      return;
    case DType::kBF16:
      InitBf16(static_cast<float*>(acc), static_cast<const uint16_t*>(src), count);
      return;
    case DType::kF16:
      InitF16(static_cast<float*>(acc), static_cast<const _Float16*>(src), count);
      return;
  }
}

void AccumulatorAdd(DType d, void* acc, const void* src, size_t count) {
  switch (d) {
    case DType::kF32:
      AddF32(static_cast<float*>(acc), static_cast<const float*>(src), count);
      return;
    case DType::kF64:
      AddF64(static_cast<double*>(acc), static_cast<const double*>(src), count);
      return;
    case DType::kI32:
      AddI32(static_cast<uint32_t*>(acc), static_cast<const uint32_t*>(src), count);
      return;
    case DType::kBF16:
      AddBf16(static_cast<float*>(acc), static_cast<const uint16_t*>(src), count);
      return;
    case DType::kF16:
      AddF16(static_cast<float*>(acc), static_cast<const _Float16*>(src), count);
      return;
  }
}

void AccumulatorInitSum(DType d, void* acc, const void* a, const void* b, size_t count) {
  switch (d) {
    case DType::kF32:
      SumF32(static_cast<float*>(acc), static_cast<const float*>(a), static_cast<const float*>(b), count);
      return;
    case DType::kF64:
      SumF64(static_cast<double*>(acc), static_cast<const double*>(a), static_cast<const double*>(b), count);
      return;
    case DType::kI32:
      SumI32(static_cast<uint32_t*>(acc), static_cast<const uint32_t*>(a), static_cast<const uint32_t*>(b), count);
      return;
    case DType::kBF16:
    case DType::kF16:
      AccumulatorInit(d, acc, a, count);
      AccumulatorAdd(d, acc, b, count);
      return;
  }
}

void AccumulatorFinish(DType d, void* dst, const void* acc, size_t count) {
  switch (d) {
    case DType::kF32:
    case DType::kF64:
    case DType::kI32:
      if (dst != acc) std::memcpy(dst, acc, count * DTypeSize(d));
      return;
    case DType::kBF16:
      FinishBf16(static_cast<uint16_t*>(dst), static_cast<const float*>(acc), count);
      return;
    case DType::kF16:
      FinishF16(static_cast<_Float16*>(dst), static_cast<const float*>(acc), count);
      return;
  }
}

}  // namespace jbps
