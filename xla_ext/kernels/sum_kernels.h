// The summation kernels of the server: convert-in, add, convert-out.
//
// An accumulator holds `count` elements of AccumulatorType(d): float for
// float32/float16/bfloat16, double for float64, int32 for int32. `param` is
// the dtype's (dtype.h). Onebit and topk rounds have none (SumsRecords).
#pragma once

#include <cstddef>

#include "common/dtype.h"

namespace jbps {

// acc[i] = widen(src[i])
void AccumulatorInit(DType d, uint16_t param, void* acc, const void* src, size_t count);
// acc[i] += widen(src[i])   (int32 wraps around, as two's complement adds do)
void AccumulatorAdd(DType d, uint16_t param, void* acc, const void* src, size_t count);
// acc[i] = widen(a[i]) + widen(b[i]): the first two pushes in one pass,
// instead of a copy and then an add.
void AccumulatorInitSum(DType d, uint16_t param, void* acc, const void* a, const void* b, size_t count);
// dst[i] = narrow(acc[i])   (round to nearest even for the 16-bit floats)
void AccumulatorFinish(DType d, uint16_t param, void* dst, const void* acc, size_t count);

// True when the accumulator has the wire layout, so a pushed buffer can become
// the accumulator and the accumulator can be sent back, with no conversion.
inline bool AccumulatorIsWire(DType d) { return d == DType::kF32 || d == DType::kF64 || d == DType::kI32; }

// True for the compressed types: a round holds its pushes' records and sums
// them once all are in, a block at a time with the key's residual
// (OneBitSumWithFeedback, TopKSumWithFeedback), where decoding each push into
// an accumulator as it came wrote and read the whole float32 sum per push.
inline bool SumsRecords(DType d) { return d == DType::kOneBit || d == DType::kTopK; }

}  // namespace jbps
