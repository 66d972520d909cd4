// Top-k compression (as BytePS's topk): of every kTopKBlock float32 values,
// the `keep` largest in magnitude travel, as (index in the block, value)
// pairs in index order; a record decodes to those values at those indices
// and zeros elsewhere. Ties go to the lower index. `keep` is the user's
// choice (1 to kTopKMaxKeep; compression="topk:FRACTION", jbps/ops/topk.py)
// and travels with every push (FrameHeader::param), so a server sizes and
// encodes records as its workers do. Workers encode on the device
// (jbps/ops/topk.py, the same format); a server decodes each push into a
// float32 accumulator of the block, adds, and encodes the sum the same way
// for the pull, keeping what the encoding dropped as its residual (error
// feedback). On XLA:CPU the workers run this encoder too (ffi_codecs_cpu.cc).
#pragma once

#include <cstddef>
#include <cstdint>

namespace jbps {

constexpr size_t kTopKBlock = 1024;  // values per record
// More than half a block would take more bytes than the float32 values.
constexpr size_t kTopKMaxKeep = kTopKBlock / 2;
constexpr size_t kTopKPairBytes = 2 * sizeof(uint32_t);  // uint32 index, float32 value

inline bool TopKKeepValid(size_t keep) { return keep >= 1 && keep <= kTopKMaxKeep; }
inline size_t TopKRecordBytes(size_t keep) { return keep * kTopKPairBytes; }

// out = decode(src): `records` records of `keep` pairs into as many blocks of kTopKBlock floats.
void TopKDecode(float* out, const uint8_t* src, size_t records, size_t keep);
// A worker's encode with error feedback: values += add (unless add is null;
// as OneBitEncodeExtract), dst = encode(values), and the values records
// carry become zeros in `values`, which then hold what is left.
void TopKEncodeExtract(uint8_t* dst, float* values, const float* add, size_t records, size_t keep);
// A server's round, error feedback included: residual += the sum of the
// `num_pushes` pushes' records (added in the order given), dst =
// encode(residual), and the values dst carries become zeros in residual. One
// block of the sum at a time, in a local buffer (as OneBitSumWithFeedback).
void TopKSumWithFeedback(uint8_t* dst, const uint8_t* const* pushes, size_t num_pushes, float* residual, size_t records,
                         size_t keep);

}  // namespace jbps
