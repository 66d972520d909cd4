// Onebit compression with scaling (as BytePS's onebit): up to kOneBitBlock
// float32 values travel as one record: their scale (the mean absolute value,
// float32), how many values the record holds (uint32; fewer than a block only
// at the end of a tensor), then one sign bit per value (set: negative; bit j
// of byte k is value 8k + j). A value decodes to +scale or -scale, the rest
// of the block to 0. Workers encode on the device (jbps/ops/onebit.py, the
// same format; on XLA:CPU with this code, ffi_codecs_cpu.cc); a server
// sums a round's pushes block by block once all are in, adds its residual
// and encodes the sum for the pull, keeping what the encoding lost as its
// residual (error feedback).
#pragma once

#include <cstddef>
#include <cstdint>

namespace jbps {

constexpr size_t kOneBitBlock = 256;  // values per record, at most
constexpr size_t kOneBitRecordBytes = 2 * sizeof(uint32_t) + kOneBitBlock / 8;

// out = decode(src): kOneBitBlock floats per record.
void OneBitDecodeValues(float* out, const uint8_t* src, size_t records);
// A worker's encode with error feedback: values += add (unless add is null:
// the gradient added to the residual, a block at a time while it is in
// cache), dst = encode(values), each block holding counts[r] values (the
// rest is padding), and values -= decode(dst): what is left, the worker's
// new residual.
void OneBitEncodeExtract(uint8_t* dst, float* values, const float* add, const int32_t* counts, size_t records);
// A server's round, error feedback included: residual += the sum of the
// `num_pushes` pushes' records (each `records` records, added in the order
// given), dst = encode(residual), residual -= decode(dst). One block of the
// sum at a time, in a local buffer: no accumulator to write and read back.
// The records' value count is the first push's. residual holds
// kOneBitBlock floats per record (zeros at first).
void OneBitSumWithFeedback(uint8_t* dst, const uint8_t* const* pushes, size_t num_pushes, float* residual,
                           size_t records);

}  // namespace jbps
