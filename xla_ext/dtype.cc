#include "dtype.h"

#include "onebit.h"
#include "topk.h"

namespace jbps {

bool DTypeValid(uint8_t raw) { return raw < kNumDTypes; }

size_t DTypeSize(DType d) {
  switch (d) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kI32: return 4;
    case DType::kOneBit: return kOneBitRecordBytes;
    case DType::kTopK: return kTopKRecordBytes;
  }
  return 0;
}

const char* DTypeName(DType d) {
  switch (d) {
    case DType::kF32: return "float32";
    case DType::kF64: return "float64";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kI32: return "int32";
    case DType::kOneBit: return "onebit";
    case DType::kTopK: return "topk";
  }
  return "invalid";
}

size_t AccumulatorSize(DType d) {
  if (d == DType::kOneBit) return kOneBitAccFloats * sizeof(float);
  if (d == DType::kTopK) return kTopKBlock * sizeof(float);
  return (d == DType::kF16 || d == DType::kBF16) ? 4 : DTypeSize(d);
}

}  // namespace jbps
