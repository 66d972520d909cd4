#include "codecs/topk.h"

#include <algorithm>
#include <cstring>
#include <functional>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "kernels/multiversion.h"
#include "kernels/sum_kernels.h"

namespace jbps {
namespace {

struct Pair {
  uint32_t index;
  float value;
};
static_assert(sizeof(Pair) == kTopKPairBytes, "a record is `keep` pairs");

template <bool kAdd>
void DecodeRecord(float* out, const uint8_t* record, size_t keep) {
  if (!kAdd) std::memset(out, 0, kTopKBlock * sizeof(float));
  for (size_t k = 0; k < keep; ++k) {
    Pair p;
    std::memcpy(&p, record + k * sizeof(Pair), sizeof(Pair));
    if (p.index >= kTopKBlock) continue;                     // a hostile index writes nowhere
    out[p.index] = kAdd ? out[p.index] + p.value : p.value;  // -0.0 stays -0.0 (as XLA's scatter)
  }
}

// A block's magnitudes as the bits of |value| (their unsigned order is the
// order of |value|, with NaN above infinity, as lax.top_k ranks them on the
// device), and the largest of each of `groups` equal groups. One pass that
// vectorises; the selection below then looks at a few candidates only.
JBPS_MULTIVERSION void Magnitudes(uint32_t* __restrict mag, uint32_t* __restrict group_max,
                                  const float* __restrict values, size_t groups) {
  for (size_t i = 0; i < kTopKBlock; ++i) {
    uint32_t bits;
    std::memcpy(&bits, values + i, sizeof(bits));
    mag[i] = bits & 0x7fffffffu;
  }
  const size_t width = kTopKBlock / groups;
  for (size_t g = 0; g < groups; ++g) {
    uint32_t m = 0;
    for (size_t i = 0; i < width; ++i) m = std::max(m, mag[g * width + i]);
    group_max[g] = m;
  }
}

// Copies the magnitudes above `low` to `above`, in index order; returns how many.
size_t CopyAbove(uint32_t* above, const uint32_t* mag, uint32_t low) {
  size_t n = 0;
  for (size_t i = 0; i < kTopKBlock; ++i) {
    above[n] = mag[i];
    n += mag[i] > low;
  }
  return n;
}

// Writes the pairs of the values above t and of the first `ties` equal to
// it, in index order, up to `keep` of them.
void TakeKept(uint8_t* record, const float* values, const uint32_t* mag, uint32_t t, size_t ties, size_t keep) {
  size_t k = 0;
  for (uint32_t i = 0; i < kTopKBlock && k < keep; ++i) {
    if (mag[i] > t || (mag[i] == t && ties > 0)) {
      if (mag[i] == t) --ties;
      const Pair p{i, values[i]};
      std::memcpy(record + k++ * sizeof(Pair), &p, sizeof(Pair));
    }
  }
}

#ifdef JBPS_HAVE_CPU_CHECKS
// For each mask of 8 lanes, its set lanes in order (the rest 0) and how many.
struct PackTable {
  uint8_t lanes[256][8];
  uint8_t count[256];
};
constexpr PackTable MakePackTable() {
  PackTable t{};
  for (unsigned m = 0; m < 256; ++m)
    for (unsigned j = 0; j < 8; ++j)
      if ((m >> j) & 1u) t.lanes[m][t.count[m]++] = static_cast<uint8_t>(j);
  return t;
}
constexpr PackTable kPack = MakePackTable();

// The same two scans 8 magnitudes at a time. Magnitudes have the sign bit
// clear, so a signed compare orders them. The copy packs each 8 values'
// share above the floor to the left (a permutation from kPack) and stores
// all 8 lanes, counting only those: no branch per value, which a share of a
// few percent above the floor (gaussian values) mispredicts often (`above`
// has room for 8 more). Skipping the groups of 8 with none above costs more
// there than it saves on blocks of equal values.
__attribute__((target("avx2"))) size_t CopyAboveAvx2(uint32_t* above, const uint32_t* mag, uint32_t low) {
  const __m256i floor = _mm256_set1_epi32(static_cast<int>(low));
  size_t n = 0;
  for (size_t c = 0; c < kTopKBlock; c += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mag + c));
    const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, floor))));
    const __m256i lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kPack.lanes[m])));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(above + n), _mm256_permutevar8x32_epi32(v, lanes));
    n += kPack.count[m];
  }
  return n;
}

__attribute__((target("avx2"))) void TakeKeptAvx2(uint8_t* record, const float* values, const uint32_t* mag, uint32_t t,
                                                  size_t ties, size_t keep) {
  const __m256i below = _mm256_set1_epi32(static_cast<int>(t) - 1);  // t > 0 here: mag > t - 1 is mag >= t
  size_t k = 0;
  for (uint32_t c = 0; c < kTopKBlock && k < keep; c += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mag + c));
    for (unsigned m = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, below))); m != 0 && k < keep;
         m &= m - 1) {
      const uint32_t i = c + static_cast<uint32_t>(__builtin_ctz(m));
      if (mag[i] == t) {
        if (ties == 0) continue;
        --ties;
      }
      const Pair p{i, values[i]};
      std::memcpy(record + k++ * sizeof(Pair), &p, sizeof(Pair));
    }
  }
}
#endif

// The `keep` largest magnitudes (ties: the lower index), in index order.
// The keep-th largest of the groups' maxima is a floor: those keep maxima
// are distinct values at least that large, so every value kept is at or
// above it. When fewer than keep values lie above the floor, the floor is
// the threshold t (the keep-th largest): so it is for a block of equal
// values, or of zeros but a few, as constant or sparse gradients give.
// Otherwise t is the keep-th largest of the few values above the floor. A
// last pass in index order takes every value above t and the first of
// those equal to t. 7x faster than sorting indices by magnitude
// (std::nth_element) for 10 of 1024, 2x for 512.
void EncodeRecord(uint8_t* record, const float* values, size_t keep) {
  uint32_t mag[kTopKBlock], group_max[kTopKBlock], above[kTopKBlock + 8];
  size_t groups = 16;
  while (groups < keep) groups *= 2;
  Magnitudes(mag, group_max, values, groups);
  std::nth_element(group_max, group_max + keep - 1, group_max + groups, std::greater<uint32_t>());
  const uint32_t low = group_max[keep - 1];
#ifdef JBPS_HAVE_CPU_CHECKS
  const bool avx2 = CpuHasAvx2();
#else
  const bool avx2 = false;
#endif
  const size_t n = avx2 ? CopyAboveAvx2(above, mag, low) : CopyAbove(above, mag, low);
  uint32_t t = low;
  size_t ties = keep - std::min(n, keep);  // values equal to t that are kept
  if (n >= keep) {
    std::nth_element(above, above + keep - 1, above + n, std::greater<uint32_t>());
    t = above[keep - 1];
    ties = keep;
    for (size_t i = 0; i < n; ++i) ties -= above[i] > t;
  }
  if (avx2 && t > 0) return TakeKeptAvx2(record, values, mag, t, ties, keep);
  TakeKept(record, values, mag, t, ties, keep);
}

// record = encode(values), and the values it carries become zeros in
// `values`: what is left, the residual of a worker (TopKEncodeExtract) or a
// server (TopKSumWithFeedback).
void EncodeLeaving(uint8_t* record, float* values, size_t keep) {
  EncodeRecord(record, values, keep);
  for (size_t k = 0; k < keep; ++k) {
    Pair p;
    std::memcpy(&p, record + k * sizeof(Pair), sizeof(Pair));
    values[p.index] = 0.0f;
  }
}

}  // namespace

void TopKDecode(float* out, const uint8_t* src, size_t records, size_t keep) {
  const size_t bytes = TopKRecordBytes(keep);
  for (size_t r = 0; r < records; ++r) DecodeRecord<false>(out + r * kTopKBlock, src + r * bytes, keep);
}

void TopKSumWithFeedback(uint8_t* dst, const uint8_t* const* pushes, size_t num_pushes, float* residual, size_t records,
                         size_t keep) {
  const size_t bytes = TopKRecordBytes(keep);
  alignas(64) float sum[kTopKBlock];
  for (size_t r = 0; r < records; ++r) {
    const size_t at = r * bytes;
    DecodeRecord<false>(sum, pushes[0] + at, keep);
    for (size_t w = 1; w < num_pushes; ++w) DecodeRecord<true>(sum, pushes[w] + at, keep);
    float* res = residual + r * kTopKBlock;
    AccumulatorAdd(DType::kF32, 0, res, sum, kTopKBlock);  // as the workers' encoders add
    EncodeLeaving(dst + at, res, keep);
  }
}

void TopKEncodeExtract(uint8_t* dst, float* values, const float* add, size_t records, size_t keep) {
  const size_t bytes = TopKRecordBytes(keep);
  for (size_t r = 0; r < records; ++r) {
    float* v = values + r * kTopKBlock;
    if (add != nullptr) AccumulatorAdd(DType::kF32, 0, v, add + r * kTopKBlock, kTopKBlock);  // the servers' add
    EncodeLeaving(dst + r * bytes, v, keep);
  }
}

}  // namespace jbps
