#include "codecs/onebit.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "kernels/multiversion.h"
#include "kernels/sum_kernels.h"

namespace jbps {
namespace {

struct Header {
  float scale;
  uint32_t count;
};

Header HeaderOf(const uint8_t* record) {
  Header h;
  std::memcpy(&h, record, sizeof(h));
  h.count = std::min<uint32_t>(h.count, kOneBitBlock);  // a hostile count reads no further
  return h;
}

// Bit 31 for each of a byte's 8 sign bits: kSigns.bits[byte][j] for value j.
struct SignTable {
  uint32_t bits[256][8];
};
constexpr SignTable MakeSignTable() {
  SignTable t{};
  for (uint32_t byte = 0; byte < 256; ++byte)
    for (uint32_t j = 0; j < 8; ++j) t.bits[byte][j] = ((byte >> j) & 1u) << 31;
  return t;
}
constexpr SignTable kSigns = MakeSignTable();

// A record's value i as float32 bits: the scale with the sign bit of value
// i, or zero past the count. A table lookup per byte and integer operations
// that vectorise: 3x faster than choosing -scale or scale per value.
inline uint32_t SignedScale(uint32_t scale, const uint32_t* signs, uint32_t i, uint32_t count) {
  return (scale ^ signs[i % 8]) & (i < count ? 0xffffffffu : 0u);
}

// out = decode(record), or out += decode(record) with `add` (a loop per case
// once GCC unswitches it).
JBPS_MULTIVERSION void DecodeValues(float* __restrict out, const uint8_t* __restrict record, bool add) {
  const Header h = HeaderOf(record);
  uint32_t scale;
  std::memcpy(&scale, &h.scale, sizeof(scale));
  const uint8_t* bits = record + sizeof(Header);
  for (uint32_t k = 0; k < kOneBitBlock / 8; ++k) {
    const uint32_t* signs = kSigns.bits[bits[k]];
    for (uint32_t j = 0; j < 8; ++j) {
      const uint32_t v = SignedScale(scale, signs, 8 * k + j, h.count);
      float f;
      std::memcpy(&f, &v, sizeof(f));
      out[8 * k + j] = add ? out[8 * k + j] + f : f;
    }
  }
}

#ifdef JBPS_HAVE_CPU_CHECKS
// DecodeValues 8 values at a time: the byte of signs broadcast and tested
// bit by bit (an and and a compare), the sign bit set on the scale where a
// bit is set, zero past the count. The same bits as the table lookup, which
// GCC does not vectorise (python -m jbps.bench.codecs: a 32 MiB decode into a
// fresh output 9.3-11.0 ms with the lookup, 5.4-6.8 with this).
template <bool kAdd>
__attribute__((target("avx2"))) void DecodeValuesAvx2(float* out, const uint8_t* record) {
  const Header h = HeaderOf(record);
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &h.scale, sizeof(scale_bits));
  const __m256i scale = _mm256_set1_epi32(static_cast<int>(scale_bits));
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i bit_of_value = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i held_below = _mm256_set1_epi32(static_cast<int>(h.count));
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  const uint8_t* bits = record + sizeof(Header);
  for (uint32_t k = 0; k < kOneBitBlock / 8; ++k) {
    const __m256i byte = _mm256_set1_epi32(bits[k]);
    const __m256i negative = _mm256_cmpeq_epi32(_mm256_and_si256(byte, bit_of_value), bit_of_value);
    const __m256i held = _mm256_cmpgt_epi32(held_below, index);  // index < count
    __m256 v = _mm256_castsi256_ps(_mm256_and_si256(_mm256_xor_si256(scale, _mm256_and_si256(negative, sign)), held));
    if (kAdd) v = _mm256_add_ps(_mm256_loadu_ps(out + 8 * k), v);
    _mm256_storeu_ps(out + 8 * k, v);
    index = _mm256_add_epi32(index, eight);
  }
}
#endif

template <bool kAdd>
void DecodeBlock(float* out, const uint8_t* record) {
#ifdef JBPS_HAVE_CPU_CHECKS
  if (CpuHasAvx2()) return DecodeValuesAvx2<kAdd>(out, record);
#endif
  DecodeValues(out, record, kAdd);
}

// The header from the eight partial sums of |value|: their sum over the count.
float FinishHeader(uint8_t* record, const double* partial, uint32_t count) {
  const double l1 =
      ((partial[0] + partial[4]) + (partial[1] + partial[5])) + ((partial[2] + partial[6]) + (partial[3] + partial[7]));
  Header h{static_cast<float>(l1 / std::max<uint32_t>(count, 1)), count};
  std::memcpy(record, &h, sizeof(h));
  return h.scale;
}

// The record's header: the mean absolute value in double, so its float32
// rounding hardly depends on the order of the additions (numpy's reference
// sums pairwise): eight partial sums (WriteHeaderAvx2 adds them 8 values at a time).
JBPS_MULTIVERSION float WriteHeader(uint8_t* __restrict record, const float* __restrict values, uint32_t count) {
  double partial[8] = {};
  for (size_t i = 0; i < kOneBitBlock; i += 8)
    for (size_t j = 0; j < 8; ++j) partial[j] += i + j < count ? std::fabs(static_cast<double>(values[i + j])) : 0.0;
  return FinishHeader(record, partial, count);
}

// The record's sign bits: value i's bit is set when i < count and value i < 0.
JBPS_MULTIVERSION void WriteSigns(uint8_t* __restrict record, const float* __restrict values, uint32_t count) {
  uint32_t negative[kOneBitBlock];
  for (uint32_t i = 0; i < kOneBitBlock; ++i) negative[i] = static_cast<uint32_t>(i < count) & (values[i] < 0.0f);
  uint8_t* bits = record + sizeof(Header);
  for (size_t k = 0; k < kOneBitBlock / 8; ++k) {
    uint32_t byte = 0;
    for (uint32_t j = 0; j < 8; ++j) byte |= negative[8 * k + j] << j;
    bits[k] = static_cast<uint8_t>(byte);
  }
}

#ifdef JBPS_HAVE_CPU_CHECKS
// WriteHeader 8 values at a time: the same eight partial sums, in the same
// order, so the same bits. GCC makes the portable loop a branch per value
// (the count's condition), which took more of a worker's encode than the
// rest of it (perf, the emulated cluster's onebit column).
__attribute__((target("avx2"))) float WriteHeaderAvx2(uint8_t* record, const float* values, uint32_t count) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i held_below = _mm256_set1_epi32(static_cast<int>(count));
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();  // partial[0..3], partial[4..7]
  for (uint32_t i = 0; i < kOneBitBlock; i += 8) {
    const __m256 held = _mm256_castsi256_ps(_mm256_cmpgt_epi32(held_below, index));  // index < count
    const __m256 v = _mm256_and_ps(_mm256_and_ps(_mm256_loadu_ps(values + i), magnitude), held);
    low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    index = _mm256_add_epi32(index, eight);
  }
  double partial[8];
  _mm256_storeu_pd(partial, low);
  _mm256_storeu_pd(partial + 4, high);
  return FinishHeader(record, partial, count);
}

// WriteSigns and values -= decode(record) in one pass, 8 values at a time:
// a compare and a movemask per byte of signs, the value sent (the scale, its
// sign bit set where negative, zero past the count) subtracted in place.
// The same bits as the portable path (a NaN is not negative in either).
__attribute__((target("avx2"))) void SignsAndLeftAvx2(uint8_t* record, float* values, uint32_t count, float scale) {
  uint8_t* bits = record + sizeof(Header);
  const __m256 zero = _mm256_setzero_ps();
  const __m256 s = _mm256_set1_ps(scale);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i held_below = _mm256_set1_epi32(static_cast<int>(count));
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  for (uint32_t k = 0; k < kOneBitBlock / 8; ++k) {
    const __m256 v = _mm256_loadu_ps(values + 8 * k);
    const __m256 held = _mm256_castsi256_ps(_mm256_cmpgt_epi32(held_below, index));  // index < count
    const __m256 negative = _mm256_and_ps(_mm256_cmp_ps(v, zero, _CMP_LT_OQ), held);
    bits[k] = static_cast<uint8_t>(_mm256_movemask_ps(negative));
    const __m256 sent = _mm256_and_ps(_mm256_xor_ps(s, _mm256_and_ps(negative, sign)), held);
    _mm256_storeu_ps(values + 8 * k, _mm256_sub_ps(v, sent));
    index = _mm256_add_epi32(index, eight);
  }
}
#endif

// The header by the fastest kernel this CPU has (the same bits either way).
float WriteHeaderBlock(uint8_t* record, const float* values, uint32_t count) {
#ifdef JBPS_HAVE_CPU_CHECKS
  if (CpuHasAvx2()) return WriteHeaderAvx2(record, values, count);
#endif
  return WriteHeader(record, values, count);
}

// record = encode(values), and values -= decode(record): what is left, the
// residual of a worker (OneBitEncodeExtract) or a server (...SumWithFeedback).
void EncodeLeaving(uint8_t* record, float* values, uint32_t count) {
  const float scale = WriteHeaderBlock(record, values, count);
#ifdef JBPS_HAVE_CPU_CHECKS
  if (CpuHasAvx2()) return SignsAndLeftAvx2(record, values, count, scale);
#endif
  WriteSigns(record, values, count);
  float sent[kOneBitBlock];
  DecodeBlock<false>(sent, record);
  for (size_t i = 0; i < kOneBitBlock; ++i) values[i] -= sent[i];  // padding: 0 - 0
}

}  // namespace

void OneBitSumWithFeedback(uint8_t* dst, const uint8_t* const* pushes, size_t num_pushes, float* residual,
                           size_t records) {
  alignas(64) float sum[kOneBitBlock];
  for (size_t r = 0; r < records; ++r) {
    const size_t at = r * kOneBitRecordBytes;
    DecodeBlock<false>(sum, pushes[0] + at);
    for (size_t w = 1; w < num_pushes; ++w) DecodeBlock<true>(sum, pushes[w] + at);
    float* res = residual + r * kOneBitBlock;
    AccumulatorAdd(DType::kF32, 0, res, sum, kOneBitBlock);  // as the workers' encoders add
    EncodeLeaving(dst + at, res, HeaderOf(pushes[0] + at).count);
  }
}

void OneBitDecodeValues(float* out, const uint8_t* src, size_t records) {
  for (size_t r = 0; r < records; ++r) DecodeBlock<false>(out + r * kOneBitBlock, src + r * kOneBitRecordBytes);
}

void OneBitEncodeExtract(uint8_t* dst, float* values, const float* add, const int32_t* counts, size_t records) {
  for (size_t r = 0; r < records; ++r) {
    const uint32_t count = static_cast<uint32_t>(std::clamp<int32_t>(counts[r], 0, kOneBitBlock));
    float* v = values + r * kOneBitBlock;
    if (add != nullptr) AccumulatorAdd(DType::kF32, 0, v, add + r * kOneBitBlock, kOneBitBlock);  // the servers' add
    EncodeLeaving(dst + r * kOneBitRecordBytes, v, count);
  }
}

}  // namespace jbps
