// Plain loops over restrict pointers, compiled for three instruction sets at
// once (target_clones: baseline x86-64, x86-64-v3 = AVX2+F16C+FMA, x86-64-v4 =
// AVX-512F/BW/DQ/VL) and picked at load time by the CPU's feature bits. The
// clones were arch=haswell and arch=skylake-avx512, whose resolver matches the
// exact CPU model (__cpu_model subtype): an Ice Lake Xeon ran the SSE2 default,
// at 0.95-0.97x numpy's AVX2 add on 256 MiB. Checked with objdump on GCC
// 12 -O3: the float32/float64/int32 adds (Add* and the two-source Sum*) and
// the bfloat16 loops vectorise (vaddps/vaddpd/vpaddd; vpmovzxwd+vpslld+vaddps
// for bfloat16) on ymm in the v3 clone and zmm in the v4 clone, and the
// resolver tests __cpu_features2.
//
// GCC 12 does not vectorise _Float16 <-> float conversions (each element went
// through a scalar vcvtph2ps), so the float16 loops are written with F16C/AVX2
// intrinsics (vcvtph2ps mem->ymm + vaddps ymm, vcvtps2ph $0x8 = round to
// nearest even; checked with objdump) and chosen at run time by
// __builtin_cpu_supports, with the portable _Float16 loops as the fallback.
// Both round to nearest even and keep NaN a NaN. A zmm (AVX-512F) float16 add
// measured about 3% faster on 256 MiB, within the noise of a shared machine:
// not worth a second copy.
//
// Measured on 256 MiB (2-core Ice Lake Xeon, jbps/bench/summation.py): the v4
// float32 add runs about 1.07x numpy's add and at 0.85-0.99 of a copy's
// bandwidth counting every array touched; float16 and bfloat16 adds sum
// 1.1-1.25x the float32 add's elements per second (they read 2 bytes of src,
// not 4). Non-temporal stores (acc is read first anyway), 4x unrolling,
// software prefetch and aligning acc were each no faster (non-temporal stores
// 10% slower), so the loop stays plain.
#include "kernels/sum_kernels.h"

#include <cstdint>
#include <cstring>

#include "kernels/multiversion.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define JBPS_F16C_KERNELS 1
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

// Portable float16 loops: the compiler's own conversions (a libgcc call per
// element without F16C), round to nearest even.
void InitF16Scalar(float* __restrict acc, const _Float16* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = static_cast<float>(src[i]);
}

void AddF16Scalar(float* __restrict acc, const _Float16* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += static_cast<float>(src[i]);
}

void FinishF16Scalar(_Float16* __restrict dst, const float* __restrict acc, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<_Float16>(acc[i]);
}

#ifdef JBPS_F16C_KERNELS
// Eight elements per step; the tail uses the scalar forms of the same
// instructions, so every element converts exactly as the vector body would.
constexpr int kRoundNearestEven = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

__attribute__((target("avx2,f16c"))) void InitF16Avx2(float* __restrict acc, const uint16_t* __restrict src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) acc[i] = _cvtsh_ss(src[i]);
}

__attribute__((target("avx2,f16c"))) void AddF16Avx2(float* __restrict acc, const uint16_t* __restrict src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), wide));
  }
  for (; i < n; ++i) acc[i] += _cvtsh_ss(src[i]);
}

__attribute__((target("avx2,f16c"))) void FinishF16Avx2(uint16_t* __restrict dst, const float* __restrict acc,
                                                        size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(acc + i), kRoundNearestEven));
  for (; i < n; ++i) dst[i] = _cvtss_sh(acc[i], kRoundNearestEven);
}

#endif

void InitF16(float* acc, const void* src, size_t n) {
#ifdef JBPS_F16C_KERNELS
  if (CpuHasAvx2F16c()) return InitF16Avx2(acc, static_cast<const uint16_t*>(src), n);
#endif
  InitF16Scalar(acc, static_cast<const _Float16*>(src), n);
}

void AddF16(float* acc, const void* src, size_t n) {
#ifdef JBPS_F16C_KERNELS
  if (CpuHasAvx2F16c()) return AddF16Avx2(acc, static_cast<const uint16_t*>(src), n);
#endif
  AddF16Scalar(acc, static_cast<const _Float16*>(src), n);
}

void FinishF16(void* dst, const float* acc, size_t n) {
#ifdef JBPS_F16C_KERNELS
  if (CpuHasAvx2F16c()) return FinishF16Avx2(static_cast<uint16_t*>(dst), acc, n);
#endif
  FinishF16Scalar(static_cast<_Float16*>(dst), acc, n);
}

}  // namespace

void AccumulatorInit(DType d, uint16_t param, void* acc, const void* src, size_t count) {
  switch (d) {
    case DType::kF32:
    case DType::kF64:
    case DType::kI32: std::memcpy(acc, src, count * DTypeSize(d, param)); return;
    case DType::kBF16: InitBf16(static_cast<float*>(acc), static_cast<const uint16_t*>(src), count); return;
    case DType::kF16: InitF16(static_cast<float*>(acc), src, count); return;
    case DType::kOneBit:
    case DType::kTopK: break;  // no accumulator (SumsRecords)
  }
}

void AccumulatorAdd(DType d, uint16_t param, void* acc, const void* src, size_t count) {
  switch (d) {
    case DType::kF32: AddF32(static_cast<float*>(acc), static_cast<const float*>(src), count); return;
    case DType::kF64: AddF64(static_cast<double*>(acc), static_cast<const double*>(src), count); return;
    case DType::kI32: AddI32(static_cast<uint32_t*>(acc), static_cast<const uint32_t*>(src), count); return;
    case DType::kBF16: AddBf16(static_cast<float*>(acc), static_cast<const uint16_t*>(src), count); return;
    case DType::kF16: AddF16(static_cast<float*>(acc), src, count); return;
    case DType::kOneBit:
    case DType::kTopK: break;  // no accumulator (SumsRecords)
  }
}

void AccumulatorInitSum(DType d, uint16_t param, void* acc, const void* a, const void* b, size_t count) {
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
      AccumulatorInit(d, param, acc, a, count);
      AccumulatorAdd(d, param, acc, b, count);
      return;
    case DType::kOneBit:
    case DType::kTopK: break;  // no accumulator (SumsRecords)
  }
}

void AccumulatorFinish(DType d, uint16_t param, void* dst, const void* acc, size_t count) {
  switch (d) {
    case DType::kF32:
    case DType::kF64:
    case DType::kI32:
      if (dst != acc) std::memcpy(dst, acc, count * DTypeSize(d, param));
      return;
    case DType::kBF16: FinishBf16(static_cast<uint16_t*>(dst), static_cast<const float*>(acc), count); return;
    case DType::kF16: FinishF16(dst, static_cast<const float*>(acc), count); return;
    case DType::kOneBit:
    case DType::kTopK: break;  // no accumulator (SumsRecords)
  }
}

}  // namespace jbps
