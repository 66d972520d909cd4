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
//
// What a psum with error feedback runs on XLA:CPU (jbps/ops/psum_primitive.py):
// the residual and the gradient stay in their own buffers, the records of a
// piece of them at a time, from block first_block on (a large leaf travels
// in pieces, each its own psum call, so that XLA encodes a piece while the
// engine sends the one before and decodes one while later ones travel):
//
// jbps_topk_encode_added:   residual, values -> records uint32[rows, 2 * keep], residual, values
//                           (residual += values, then encoded, what is left
//                           kept in it; values passed through unchanged, so
//                           that the sums can go into their buffer after the
//                           last piece is encoded)        (attributes keep, first_block)
// jbps_onebit_encode_added: residual, values, counts int32[rows] -> records uint8[rows,
//                           kOneBitRecordBytes], residual, values   (the same; attribute first_block)
// jbps_topk_decode_into:    records, values -> values: the records' blocks decoded into the
//                           values' buffer, the rest as it was  (attributes keep, first_block)
// jbps_onebit_decode_into:  records, values -> values           (attribute first_block)
#include "ffi/ffi_codecs_cpu.h"

#include <cstdint>
#include <cstring>
#include <string>

#include "codecs/onebit.h"
#include "codecs/topk.h"
#include "engine/engine.h"
#include "ffi/fresh_output.h"
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

// How many blocks of `values` values (whole blocks of `block`) records of
// `record_bytes` in all, `bytes_per_record` each, hold from block `first`
// on; *error names what does not fit when they do not.
size_t Piece(const char* what, size_t values, size_t record_bytes, size_t block, size_t bytes_per_record, int64_t first,
             std::string* error) {
  const size_t rows = record_bytes / bytes_per_record;
  if (values % block != 0 || record_bytes % bytes_per_record != 0) {
    *error = std::string(what) + ": " + std::to_string(values) + " values and " + std::to_string(record_bytes) +
             " bytes of records are not whole blocks of " + std::to_string(block) + " in records of " +
             std::to_string(bytes_per_record) + " bytes";
  } else if (first < 0 || static_cast<size_t>(first) > values / block ||
             rows > values / block - static_cast<size_t>(first)) {
    *error = std::string(what) + ": " + std::to_string(rows) + " records from block " + std::to_string(first) +
             " do not fit in " + std::to_string(values / block) + " blocks of values";
  }
  return rows;
}

// The residual's and the values' buffers as the _added encoders' results
// (aliased, unless XLA gave a result its own buffer: then a copy first), or
// null with *error when their sizes differ.
float* AddedInPlace(const char* what, ffi::Buffer<ffi::F32>& residual, ffi::Buffer<ffi::F32>& values,
                    ffi::Result<ffi::Buffer<ffi::F32>>& residual_out, ffi::Result<ffi::Buffer<ffi::F32>>& values_out,
                    std::string* error) {
  if (values.element_count() != residual.element_count() || residual_out->element_count() != residual.element_count() ||
      values_out->element_count() != values.element_count()) {
    *error = std::string(what) + ": the residual and the values differ in size";
    return nullptr;
  }
  if (values_out->typed_data() != values.typed_data())
    std::memcpy(values_out->typed_data(), values.typed_data(), values.size_bytes());
  if (residual_out->typed_data() != residual.typed_data())
    std::memcpy(residual_out->typed_data(), residual.typed_data(), residual.size_bytes());
  return residual_out->typed_data();
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
  TopKEncodeExtract(reinterpret_cast<uint8_t*>(records->typed_data()), LeftIn(values, left), nullptr, blocks,
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
  OneBitEncodeExtract(records->typed_data(), LeftIn(values, left), nullptr, counts.typed_data(), blocks);
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

ffi::Error TopKEncodeAddedCpu(ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::F32> values,
                              ffi::ResultBuffer<ffi::U32> records, ffi::ResultBuffer<ffi::F32> residual_out,
                              ffi::ResultBuffer<ffi::F32> values_out, int64_t keep, int64_t first_block) {
  const char* what = "jbps_topk_encode_added";
  std::string error;
  if (!KeepValid(what, keep, &error)) return Invalid(error);
  const size_t rows = Piece(what, values.element_count(), records->size_bytes(), kTopKBlock,
                            TopKRecordBytes(static_cast<size_t>(keep)), first_block, &error);
  float* left = error.empty() ? AddedInPlace(what, residual, values, residual_out, values_out, &error) : nullptr;
  if (!error.empty()) return Invalid(error);
  const size_t at = static_cast<size_t>(first_block) * kTopKBlock;
  TopKEncodeExtract(reinterpret_cast<uint8_t*>(records->typed_data()), left + at, values_out->typed_data() + at, rows,
                    static_cast<size_t>(keep));
  return ffi::Error::Success();
}

ffi::Error TopKDecodeIntoCpu(ffi::Buffer<ffi::U32> records, ffi::Buffer<ffi::F32> into,
                             ffi::ResultBuffer<ffi::F32> values, int64_t keep, int64_t first_block) {
  const char* what = "jbps_topk_decode_into";
  std::string error;
  if (!KeepValid(what, keep, &error)) return Invalid(error);
  const size_t rows = Piece(what, values->element_count(), records.size_bytes(), kTopKBlock,
                            TopKRecordBytes(static_cast<size_t>(keep)), first_block, &error);
  if (error.empty() && into.element_count() != values->element_count())
    error = std::string(what) + ": the values differ from the buffer they go into in size";
  if (!error.empty()) return Invalid(error);
  if (values->typed_data() != into.typed_data())
    std::memcpy(values->typed_data(), into.typed_data(), into.size_bytes());
  TopKDecode(values->typed_data() + static_cast<size_t>(first_block) * kTopKBlock,
             reinterpret_cast<const uint8_t*>(records.typed_data()), rows, static_cast<size_t>(keep));
  return ffi::Error::Success();
}

ffi::Error OneBitEncodeAddedCpu(ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::F32> values,
                                ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::U8> records,
                                ffi::ResultBuffer<ffi::F32> residual_out, ffi::ResultBuffer<ffi::F32> values_out,
                                int64_t first_block) {
  const char* what = "jbps_onebit_encode_added";
  std::string error;
  const size_t rows =
      Piece(what, values.element_count(), records->size_bytes(), kOneBitBlock, kOneBitRecordBytes, first_block, &error);
  if (error.empty() && counts.element_count() != rows)
    error = std::string(what) + ": " + std::to_string(counts.element_count()) + " counts for " + std::to_string(rows) +
            " records";
  float* left = error.empty() ? AddedInPlace(what, residual, values, residual_out, values_out, &error) : nullptr;
  if (!error.empty()) return Invalid(error);
  const size_t at = static_cast<size_t>(first_block) * kOneBitBlock;
  OneBitEncodeExtract(records->typed_data(), left + at, values_out->typed_data() + at, counts.typed_data(), rows);
  return ffi::Error::Success();
}

ffi::Error OneBitDecodeIntoCpu(ffi::Buffer<ffi::U8> records, ffi::Buffer<ffi::F32> into,
                               ffi::ResultBuffer<ffi::F32> values, int64_t first_block) {
  const char* what = "jbps_onebit_decode_into";
  std::string error;
  const size_t rows =
      Piece(what, values->element_count(), records.size_bytes(), kOneBitBlock, kOneBitRecordBytes, first_block, &error);
  if (error.empty() && into.element_count() != values->element_count())
    error = std::string(what) + ": the values differ from the buffer they go into in size";
  if (!error.empty()) return Invalid(error);
  if (values->typed_data() != into.typed_data())
    std::memcpy(values->typed_data(), into.typed_data(), into.size_bytes());
  OneBitDecodeValues(values->typed_data() + static_cast<size_t>(first_block) * kOneBitBlock, records.typed_data(),
                     rows);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbpsTopKEncodeAddedCpu, TopKEncodeAddedCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("keep")
                                  .Attr<int64_t>("first_block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbpsTopKDecodeIntoCpu, TopKDecodeIntoCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("keep")
                                  .Attr<int64_t>("first_block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbpsOneBitEncodeAddedCpu, OneBitEncodeAddedCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("first_block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbpsOneBitDecodeIntoCpu, OneBitDecodeIntoCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("first_block"));

}  // namespace jbps
