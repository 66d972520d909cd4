#include "onebit.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "multiversion.h"

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

// An accumulator (kAdd, or kCount: a server's) keeps the count after its block.
template <bool kAdd, bool kCount = true>
void DecodeRecord(float* out, const uint8_t* record) {
  DecodeValues(out, record, kAdd);
  if (!kAdd && kCount) {
    const uint32_t count = HeaderOf(record).count;
    std::memcpy(out + kOneBitBlock, &count, sizeof(count));
  }
}

// The mean absolute value in double, so its float32 rounding hardly depends
// on the order of the additions (numpy's reference sums pairwise): eight
// partial sums, which vectorise, then the sign bits.
JBPS_MULTIVERSION void EncodeRecord(uint8_t* __restrict record, const float* __restrict values, uint32_t count) {
  double partial[8] = {};
  for (size_t i = 0; i < kOneBitBlock; i += 8)
    for (size_t j = 0; j < 8; ++j) partial[j] += i + j < count ? std::fabs(static_cast<double>(values[i + j])) : 0.0;
  const double l1 =
      ((partial[0] + partial[4]) + (partial[1] + partial[5])) + ((partial[2] + partial[6]) + (partial[3] + partial[7]));
  Header h{static_cast<float>(l1 / std::max<uint32_t>(count, 1)), count};
  std::memcpy(record, &h, sizeof(h));
  uint32_t negative[kOneBitBlock];
  for (uint32_t i = 0; i < kOneBitBlock; ++i) negative[i] = static_cast<uint32_t>(i < count) & (values[i] < 0.0f);
  uint8_t* bits = record + sizeof(Header);
  for (size_t k = 0; k < kOneBitBlock / 8; ++k) {
    uint32_t byte = 0;
    for (uint32_t j = 0; j < 8; ++j) byte |= negative[8 * k + j] << j;
    bits[k] = static_cast<uint8_t>(byte);
  }
}

// record = encode(values), and values -= decode(record): what is left, the
// residual of a worker (OneBitEncodeExtract) or a server (...WithFeedback).
void EncodeLeaving(uint8_t* record, float* values, uint32_t count) {
  EncodeRecord(record, values, count);
  float sent[kOneBitBlock];
  DecodeRecord<false, false>(sent, record);
  for (size_t i = 0; i < kOneBitBlock; ++i) values[i] -= sent[i];  // padding: 0 - 0
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

void OneBitEncodeWithFeedback(uint8_t* dst, const float* acc, float* residual, size_t records) {
  for (size_t r = 0; r < records; ++r) {
    const float* a = acc + r * kOneBitAccFloats;
    float* res = residual + r * kOneBitBlock;
    for (size_t i = 0; i < kOneBitBlock; ++i) res[i] += a[i];
    EncodeLeaving(dst + r * kOneBitRecordBytes, res, CountOf(a));
  }
}

void OneBitDecodeValues(float* out, const uint8_t* src, size_t records) {
  for (size_t r = 0; r < records; ++r) DecodeRecord<false, false>(out + r * kOneBitBlock, src + r * kOneBitRecordBytes);
}

void OneBitEncodeExtract(uint8_t* dst, float* values, const int32_t* counts, size_t records) {
  for (size_t r = 0; r < records; ++r) {
    const uint32_t count = static_cast<uint32_t>(std::clamp<int32_t>(counts[r], 0, kOneBitBlock));
    EncodeLeaving(dst + r * kOneBitRecordBytes, values + r * kOneBitBlock, count);
  }
}

}  // namespace jbps
