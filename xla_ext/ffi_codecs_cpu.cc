// The workers' half of onebit and top-k compression on XLA:CPU, with the
// servers' own code (onebit.h, topk.h); on GPUs the codecs stay in XLA ops
// (jbps/ops/onebit.py, topk.py pick by platform) and write the same records.
// `python -m jbps.bench.codecs` times both: for 32 MiB on the 2-core EPYC
// development machine, top-k encoding took 7-15 ms against 50-73 ms for
// lax.top_k, sort and scatter, and decoding 6 ms against 12-15 ms.
//
// Encoders run in place: values float32[blocks * BLOCK] -> records and the
// values left once the records' are taken out (the worker's new residual),
// in the values' own buffer (aliased): no fresh output to fault in, and no
// subtraction after. Decoders write a fresh output, backed by huge pages.
//
// jbps_topk_encode:   values -> records uint32[blocks, 2 * keep], left   (attribute keep)
// jbps_topk_decode:   records uint32[blocks, 2 * keep] -> values         (attribute keep)
// jbps_onebit_encode: values, counts int32[blocks] (values each block holds;
//                     the rest is padding) -> records uint8[blocks, kOneBitRecordBytes], left
// jbps_onebit_decode: records uint8[blocks, kOneBitRecordBytes] -> values
#include "ffi_codecs_cpu.h"

#include <cstdint>
#include <cstring>
#include <string>

#include "engine.h"
#include "fresh_output.h"
#include "onebit.h"
#include "topk.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jbps {
namespace {

ffi::Error Invalid(const std::string& what) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, what); }

// The blocks of `block` values that `values` hold when `record_bytes` of
// records hold one each, or 0 with *error naming what does not fit.
size_t Blocks(const char* what, size_t values, size_t record_bytes, size_t block, size_t bytes_per_record,
              std::string* error) {
  const size_t blocks = values / block;
  if (values % block != 0 || record_bytes != blocks * bytes_per_record)
    *error = std::string(what) + ": " + std::to_string(values) + " values and " + std::to_string(record_bytes) +
             " bytes of records are not whole blocks of " + std::to_string(block) + " in records of " +
             std::to_string(bytes_per_record) + " bytes";
  return blocks;
}

bool KeepValid(const char* what, int64_t keep, std::string* error) {
  if (keep >= 1 && static_cast<size_t>(keep) <= kTopKMaxKeep) return true;
  *error = std::string(what) + ": keep must be 1 to " + std::to_string(kTopKMaxKeep) + ", got " + std::to_string(keep);
  return false;
}

// The values' buffer, where what is left goes: aliased, unless XLA gave the
// result its own buffer (the values live on), then a copy first.
float* LeftIn(ffi::Buffer<ffi::F32>& values, ffi::Result<ffi::Buffer<ffi::F32>>& left) {
  float* out = left->typed_data();
  if (out != values.typed_data()) std::memcpy(out, values.typed_data(), values.size_bytes());
  return out;
}

// A fresh buffer every call: huge pages fault it in 512 times fewer times
// (12 ms of 16 for 32 MiB), as for a psum's fresh output (fresh_output.h).
void PrepareDecoded(ffi::Result<ffi::Buffer<ffi::F32>>& values) {
  if (Engine::Get().huge_pages()) PrepareFreshOutput(values->typed_data(), values->size_bytes());
}

ffi::Error TopKEncodeCpu(ffi::Buffer<ffi::F32> values, ffi::ResultBuffer<ffi::U32> records,
                         ffi::ResultBuffer<ffi::F32> left, int64_t keep) {
  std::string error;
  if (!KeepValid("jbps_topk_encode", keep, &error)) return Invalid(error);
  const size_t blocks = Blocks("jbps_topk_encode", values.element_count(), records->size_bytes(), kTopKBlock,
                               TopKRecordBytes(static_cast<size_t>(keep)), &error);
  if (error.empty() && left->element_count() != values.element_count())
    error = "jbps_topk_encode: the values left differ from the values in size";
  if (!error.empty()) return Invalid(error);
  TopKEncodeExtract(reinterpret_cast<uint8_t*>(records->typed_data()), LeftIn(values, left), blocks,
                    static_cast<size_t>(keep));
  return ffi::Error::Success();
}

ffi::Error TopKDecodeCpu(ffi::Buffer<ffi::U32> records, ffi::ResultBuffer<ffi::F32> values, int64_t keep) {
  std::string error;
  if (!KeepValid("jbps_topk_decode", keep, &error)) return Invalid(error);
  const size_t blocks = Blocks("jbps_topk_decode", values->element_count(), records.size_bytes(), kTopKBlock,
                               TopKRecordBytes(static_cast<size_t>(keep)), &error);
  if (!error.empty()) return Invalid(error);
  PrepareDecoded(values);
  TopKDecode(values->typed_data(), reinterpret_cast<const uint8_t*>(records.typed_data()), blocks,
             static_cast<size_t>(keep));
  return ffi::Error::Success();
}

ffi::Error OneBitEncodeCpu(ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> counts,
                           ffi::ResultBuffer<ffi::U8> records, ffi::ResultBuffer<ffi::F32> left) {
  std::string error;
  const size_t blocks = Blocks("jbps_onebit_encode", values.element_count(), records->size_bytes(), kOneBitBlock,
                               kOneBitRecordBytes, &error);
  if (error.empty() && counts.element_count() != blocks)
    error = "jbps_onebit_encode: " + std::to_string(counts.element_count()) + " counts for " + std::to_string(blocks) +
            " blocks";
  if (error.empty() && left->element_count() != values.element_count())
    error = "jbps_onebit_encode: the values left differ from the values in size";
  if (!error.empty()) return Invalid(error);
  OneBitEncodeExtract(records->typed_data(), LeftIn(values, left), counts.typed_data(), blocks);
  return ffi::Error::Success();
}

ffi::Error OneBitDecodeCpu(ffi::Buffer<ffi::U8> records, ffi::ResultBuffer<ffi::F32> values) {
  std::string error;
  const size_t blocks = Blocks("jbps_onebit_decode", values->element_count(), records.size_bytes(), kOneBitBlock,
                               kOneBitRecordBytes, &error);
  if (!error.empty()) return Invalid(error);
  PrepareDecoded(values);
  OneBitDecodeValues(values->typed_data(), records.typed_data(), blocks);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbpsTopKEncodeCpu, TopKEncodeCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("keep"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JbpsTopKDecodeCpu, TopKDecodeCpu,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::U32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<int64_t>("keep"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbpsOneBitEncodeCpu, OneBitEncodeCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbpsOneBitDecodeCpu, OneBitDecodeCpu,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::U8>>().Ret<ffi::Buffer<ffi::F32>>());

}  // namespace jbps
