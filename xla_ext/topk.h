// Top-k compression (as BytePS's topk): of every kTopKBlock float32 values,
// the kTopKKeep largest in magnitude travel, as (index in the block, value)
// pairs in index order; a record decodes to those values at those indices
// and zeros elsewhere. Ties go to the lower index. Workers encode on the
// device (jbps/ops/topk.py, the same format); a server decodes each push into
// a float32 accumulator of the block, adds, and encodes the sum the same way
// for the pull, keeping what the encoding dropped as its residual (error
// feedback).
#pragma once

#include <cstddef>
#include <cstdint>

namespace jbps {

constexpr size_t kTopKBlock = 1024;  // values per record
constexpr size_t kTopKKeep = 10;     // values a record keeps: about 1%
constexpr size_t kTopKRecordBytes = kTopKKeep * 2 * sizeof(uint32_t);

// acc = decode(src): `records` records into as many blocks of kTopKBlock floats.
void TopKDecode(float* acc, const uint8_t* src, size_t records);
// acc += decode(src)
void TopKDecodeAdd(float* acc, const uint8_t* src, size_t records);
// dst = encode(acc)
void TopKEncode(uint8_t* dst, const float* acc, size_t records);
// Error feedback: acc += residual; dst = encode(acc); residual = acc - decode(dst).
void TopKEncodeWithFeedback(uint8_t* dst, float* acc, float* residual, size_t records);

}  // namespace jbps
