#include "topk.h"

#include <algorithm>
#include <cmath>
#include <cstring>

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
    if (p.index < kTopKBlock) out[p.index] += p.value;  // a hostile index writes nowhere
  }
}

// The `keep` largest |values| (ties: the lower index), in index order;
// their indices are the first `keep` of *order on return.
void EncodeRecord(uint8_t* record, const float* values, uint32_t (&order)[kTopKBlock], size_t keep) {
  for (uint32_t i = 0; i < kTopKBlock; ++i) order[i] = i;
  auto larger = [values](uint32_t a, uint32_t b) {
    const float x = std::fabs(values[a]), y = std::fabs(values[b]);
    return x != y ? x > y : a < b;
  };
  std::nth_element(order, order + keep - 1, order + kTopKBlock, larger);
  std::sort(order, order + keep);
  for (size_t k = 0; k < keep; ++k) {
    const Pair p{order[k], values[order[k]]};
    std::memcpy(record + k * sizeof(Pair), &p, sizeof(Pair));
  }
}

}  // namespace

void TopKDecode(float* acc, const uint8_t* src, size_t records, size_t keep) {
  const size_t bytes = TopKRecordBytes(keep);
  for (size_t r = 0; r < records; ++r) DecodeRecord<false>(acc + r * kTopKBlock, src + r * bytes, keep);
}

void TopKDecodeAdd(float* acc, const uint8_t* src, size_t records, size_t keep) {
  const size_t bytes = TopKRecordBytes(keep);
  for (size_t r = 0; r < records; ++r) DecodeRecord<true>(acc + r * kTopKBlock, src + r * bytes, keep);
}

void TopKEncode(uint8_t* dst, const float* acc, size_t records, size_t keep) {
  const size_t bytes = TopKRecordBytes(keep);
  uint32_t order[kTopKBlock];
  for (size_t r = 0; r < records; ++r) EncodeRecord(dst + r * bytes, acc + r * kTopKBlock, order, keep);
}

void TopKEncodeWithFeedback(uint8_t* dst, float* acc, float* residual, size_t records, size_t keep) {
  const size_t bytes = TopKRecordBytes(keep);
  uint32_t order[kTopKBlock];
  for (size_t r = 0; r < records; ++r) {
    float* a = acc + r * kTopKBlock;
    float* res = residual + r * kTopKBlock;
    for (size_t i = 0; i < kTopKBlock; ++i) a[i] += res[i];
    EncodeRecord(dst + r * bytes, a, order, keep);
    std::memcpy(res, a, kTopKBlock * sizeof(float));
    for (size_t k = 0; k < keep; ++k) res[order[k]] = 0.0f;  // what was sent leaves no residual
  }
}

}  // namespace jbps
