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
static_assert(sizeof(Pair) * kTopKKeep == kTopKRecordBytes, "a record is kTopKKeep pairs");

template <bool kAdd>
void DecodeRecord(float* out, const uint8_t* record) {
  if (!kAdd) std::memset(out, 0, kTopKBlock * sizeof(float));
  Pair pairs[kTopKKeep];
  std::memcpy(pairs, record, sizeof(pairs));
  for (const Pair& p : pairs) {
    if (p.index < kTopKBlock) out[p.index] += p.value;  // a hostile index writes nowhere
  }
}

// The kTopKKeep largest |values| (ties: the lower index), in index order;
// their indices are the first kTopKKeep of *order on return.
void EncodeRecord(uint8_t* record, const float* values, uint32_t (&order)[kTopKBlock]) {
  for (uint32_t i = 0; i < kTopKBlock; ++i) order[i] = i;
  auto larger = [values](uint32_t a, uint32_t b) {
    const float x = std::fabs(values[a]), y = std::fabs(values[b]);
    return x != y ? x > y : a < b;
  };
  std::nth_element(order, order + kTopKKeep - 1, order + kTopKBlock, larger);
  std::sort(order, order + kTopKKeep);
  Pair pairs[kTopKKeep];
  for (size_t k = 0; k < kTopKKeep; ++k) pairs[k] = Pair{order[k], values[order[k]]};
  std::memcpy(record, pairs, sizeof(pairs));
}

}  // namespace

void TopKDecode(float* acc, const uint8_t* src, size_t records) {
  for (size_t r = 0; r < records; ++r) DecodeRecord<false>(acc + r * kTopKBlock, src + r * kTopKRecordBytes);
}

void TopKDecodeAdd(float* acc, const uint8_t* src, size_t records) {
  for (size_t r = 0; r < records; ++r) DecodeRecord<true>(acc + r * kTopKBlock, src + r * kTopKRecordBytes);
}

void TopKEncode(uint8_t* dst, const float* acc, size_t records) {
  uint32_t order[kTopKBlock];
  for (size_t r = 0; r < records; ++r) EncodeRecord(dst + r * kTopKRecordBytes, acc + r * kTopKBlock, order);
}

void TopKEncodeWithFeedback(uint8_t* dst, float* acc, float* residual, size_t records) {
  uint32_t order[kTopKBlock];
  for (size_t r = 0; r < records; ++r) {
    float* a = acc + r * kTopKBlock;
    float* res = residual + r * kTopKBlock;
    for (size_t i = 0; i < kTopKBlock; ++i) a[i] += res[i];
    EncodeRecord(dst + r * kTopKRecordBytes, a, order);
    std::memcpy(res, a, kTopKBlock * sizeof(float));
    for (size_t k = 0; k < kTopKKeep; ++k) res[order[k]] = 0.0f;  // what was sent leaves no residual
  }
}

}  // namespace jbps
