// Onebit compression with scaling (as BytePS's onebit): up to kOneBitBlock
// float32 values travel as one record: their scale (the mean absolute value,
// float32), how many values the record holds (uint32; fewer than a block only
// at the end of a tensor), then one sign bit per value (set: negative; bit j
// of byte k is value 8k + j). A value decodes to +scale or -scale, the rest
// of the block to 0. Workers encode on the device (jbps/ops/onebit.py, the
// same format; on XLA:CPU with this code, ffi_codecs_cpu.cc); a server
// decodes each push into a float32 accumulator, adds, and encodes the sum
// for the pull, keeping what the encoding lost as its residual (error
// feedback).
#pragma once

#include <cstddef>
#include <cstdint>

namespace jbps {

constexpr size_t kOneBitBlock = 256;  // values per record, at most
constexpr size_t kOneBitRecordBytes = 2 * sizeof(uint32_t) + kOneBitBlock / 8;
// A record's accumulator: its block of floats, then its value count (as
// uint32 bits), padded to keep every block 64-byte aligned.
constexpr size_t kOneBitAccFloats = kOneBitBlock + 16;

// acc = decode(src): `records` records into as many accumulators.
void OneBitDecode(float* acc, const uint8_t* src, size_t records);
// acc += decode(src)
void OneBitDecodeAdd(float* acc, const uint8_t* src, size_t records);
// dst = encode(acc)
void OneBitEncode(uint8_t* dst, const float* acc, size_t records);
// out = decode(src) as plain values: kOneBitBlock floats per record, no count.
void OneBitDecodeValues(float* out, const uint8_t* src, size_t records);
// A worker's encode with error feedback: dst = encode(values), each block
// holding counts[r] values (the rest is padding), and values -= decode(dst):
// what is left, the worker's new residual.
void OneBitEncodeExtract(uint8_t* dst, float* values, const int32_t* counts, size_t records);
// Error feedback: residual += acc; dst = encode(residual); residual -= decode(dst).
// residual holds kOneBitBlock floats per record (zeros at first).
void OneBitEncodeWithFeedback(uint8_t* dst, const float* acc, float* residual, size_t records);

}  // namespace jbps
