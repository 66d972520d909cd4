#include "common/dtype.h"

#include "codecs/onebit.h"
#include "codecs/topk.h"

namespace jbps {

bool DTypeValid(uint8_t raw) { return raw < kNumDTypes; }

bool DTypeParamValid(DType d, uint32_t param) { return d == DType::kTopK ? TopKKeepValid(param) : param == 0; }

size_t DTypeSize(DType d, uint16_t param) {
  switch (d) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kI32: return 4;
    case DType::kOneBit: return kOneBitRecordBytes;
    case DType::kTopK: return TopKRecordBytes(param);
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

std::string DTypeDescription(DType d, uint16_t param) {
  if (d == DType::kTopK)
    return std::string(DTypeName(d)) + " keeping " + std::to_string(param) + " of " + std::to_string(kTopKBlock);
  return DTypeName(d);
}

size_t AccumulatorSize(DType d) { return (d == DType::kF16 || d == DType::kBF16) ? 4 : DTypeSize(d, 0); }

}  // namespace jbps
