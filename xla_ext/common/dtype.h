// Element types jbps can sum, as they travel on the wire.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace jbps {

// kOneBit, kTopK: compressed float32 (onebit.h, topk.h); the element is one
// record, a block of values, and it accumulates as those values in float32.
// A dtype travels with a parameter (FrameHeader::param): for kTopK the values
// a record keeps, which sizes the record; 0 for every other dtype.
enum class DType : uint8_t { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kI32 = 4, kOneBit = 5, kTopK = 6 };

constexpr int kNumDTypes = 7;

bool DTypeValid(uint8_t raw);
// Whether `param` is one `d` can travel with (d valid).
bool DTypeParamValid(DType d, uint32_t param);
// Bytes of one element of `d` with `param` (valid).
size_t DTypeSize(DType d, uint16_t param);
const char* DTypeName(DType d);
// The name, with the parameter where it matters ("topk keeping 51 of 1024"): for errors.
std::string DTypeDescription(DType d, uint16_t param);

// Servers accumulate 16-bit floats in float32 so that sums over many workers
// do not lose precision at every addition; other types accumulate as
// themselves (onebit and topk rounds have no accumulator: sum_kernels.h).
size_t AccumulatorSize(DType d);

}  // namespace jbps
