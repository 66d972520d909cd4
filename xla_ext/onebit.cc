#include "onebit.h"

#include <algorithm>
#include <cmath>
#include <cstring>

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

uint32_t CountOf(const float* acc) {
  uint32_t count;
  std::memcpy(&count, acc + kOneBitBlock, sizeof(count));
  return count;
}

// Written so the compiler vectorises them: a byte's 8 values, branch-free.
template <bool kAdd>
void DecodeRecord(float* out, const uint8_t* record) {
  const Header h = HeaderOf(record);
  const uint8_t* bits = record + sizeof(Header);
  for (size_t k = 0; k < kOneBitBlock / 8; ++k) {
    const unsigned byte = bits[k];
    for (unsigned j = 0; j < 8; ++j) {
      const size_t i = 8 * k + j;
      const float v = i >= h.count ? 0.0f : ((byte >> j) & 1u) ? -h.scale : h.scale;
      if (kAdd) {
        out[i] += v;
      } else {
        out[i] = v;
      }
    }
  }
  if (!kAdd) std::memcpy(out + kOneBitBlock, &h.count, sizeof(h.count));
}

void EncodeRecord(uint8_t* record, const float* values, uint32_t count) {
  // The mean absolute value in double, so its float32 rounding hardly
  // depends on the order of the additions (numpy's reference sums pairwise).
  double l1 = 0;
  for (size_t i = 0; i < count; ++i) l1 += std::fabs(static_cast<double>(values[i]));
  Header h{static_cast<float>(l1 / std::max<uint32_t>(count, 1)), count};
  std::memcpy(record, &h, sizeof(h));
  uint8_t* bits = record + sizeof(Header);
  for (size_t k = 0; k < kOneBitBlock / 8; ++k) {
    unsigned byte = 0;
    for (unsigned j = 0; j < 8; ++j) {
      const size_t i = 8 * k + j;
      byte |= static_cast<unsigned>(i < count && values[i] < 0.0f) << j;
    }
    bits[k] = static_cast<uint8_t>(byte);
  }
}

}  // namespace

void OneBitDecode(float* acc, const uint8_t* src, size_t records) {
  for (size_t r = 0; r < records; ++r) DecodeRecord<false>(acc + r * kOneBitAccFloats, src + r * kOneBitRecordBytes);
}

void OneBitDecodeAdd(float* acc, const uint8_t* src, size_t records) {
  for (size_t r = 0; r < records; ++r) DecodeRecord<true>(acc + r * kOneBitAccFloats, src + r * kOneBitRecordBytes);
}

void OneBitEncode(uint8_t* dst, const float* acc, size_t records) {
  for (size_t r = 0; r < records; ++r) {
    const float* a = acc + r * kOneBitAccFloats;
    EncodeRecord(dst + r * kOneBitRecordBytes, a, CountOf(a));
  }
}

void OneBitEncodeWithFeedback(uint8_t* dst, float* acc, float* residual, size_t records) {
  for (size_t r = 0; r < records; ++r) {
    float* a = acc + r * kOneBitAccFloats;
    float* res = residual + r * kOneBitBlock;
    uint8_t* record = dst + r * kOneBitRecordBytes;
    for (size_t i = 0; i < kOneBitBlock; ++i) a[i] += res[i];
    EncodeRecord(record, a, CountOf(a));
    const Header h = HeaderOf(record);
    const uint8_t* bits = record + sizeof(Header);
    for (size_t i = 0; i < kOneBitBlock; ++i) {
      const float sent = i >= h.count ? 0.0f : ((bits[i / 8] >> (i % 8)) & 1u) ? -h.scale : h.scale;
      res[i] = a[i] - sent;
    }
  }
}

}  // namespace jbps
