// Checking and describing one operand of jbps_psum, shared by the FFI
// handlers: the XLA buffer's dtype and size, and its plan attributes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "codecs/topk.h"
#include "engine/engine.h"
#include "xla/ffi/api/ffi.h"

namespace jbps {

inline bool ToDType(xla::ffi::DataType t, DType* out) {
  switch (t) {
    case xla::ffi::DataType::F32: *out = DType::kF32; return true;
    case xla::ffi::DataType::F64: *out = DType::kF64; return true;
    case xla::ffi::DataType::F16: *out = DType::kF16; return true;
    case xla::ffi::DataType::BF16: *out = DType::kBF16; return true;
    case xla::ffi::DataType::S32: *out = DType::kI32; return true;
    // jbps sums no uint8 or uint32 tensor: such an operand is compressed
    // records, onebit's bytes (ops/onebit.py) or topk's words (ops/topk.py).
    case xla::ffi::DataType::U8: *out = DType::kOneBit; return true;
    case xla::ffi::DataType::U32: *out = DType::kTopK; return true;
    default: return false;
  }
}

// Fills op's dtype, size, key and priority from operand i and its result, and
// gives the buffers' addresses (device addresses on GPUs) in *in and *out.
// Returns the error naming the operand, or an empty string.
inline std::string DescribeOperand(size_t i, const xla::ffi::ErrorOr<xla::ffi::AnyBuffer>& in,
                                   xla::ffi::ErrorOr<xla::ffi::Result<xla::ffi::AnyBuffer>> out, int64_t leaf_key,
                                   int64_t priority, Operand* op, const void** in_data, void** out_data) {
  if (!in.has_value() || !out.has_value()) return "jbps_psum: operand " + std::to_string(i) + " is not a buffer";
  if (!ToDType(in->element_type(), &op->dtype))
    return "jbps_psum: operand " + std::to_string(i) + " has a dtype jbps cannot sum";
  if ((*out)->size_bytes() != in->size_bytes())
    return "jbps_psum: result " + std::to_string(i) + " differs in size from its operand";
  op->param = 0;
  if (op->dtype == DType::kTopK) {
    // Topk records are uint32[n, 2 * keep] (ops/topk.py): the last dimension gives the keep.
    auto dims = in->dimensions();
    const int64_t words = dims.size() == 2 ? dims[1] : 0;
    if (words % 2 != 0 || !TopKKeepValid(static_cast<size_t>(words / 2)))
      return "jbps_psum: operand " + std::to_string(i) + " holds topk records as uint32[n, 2 * keep] with keep 1 to " +
             std::to_string(kTopKMaxKeep) + ", got another shape";
    op->param = static_cast<uint16_t>(words / 2);
  }
  *in_data = in->untyped_data();
  *out_data = (*out)->untyped_data();
  op->nbytes = in->size_bytes();
  op->base_key = static_cast<uint64_t>(leaf_key);
  op->priority = priority;
  return "";
}

// jbps_psum's attributes, in the order every handler binds them after its
// operands: leaf_keys, priorities, names, partition_bytes, chunk_servers,
// tree, tree_key (XLA refuses a call whose attributes the handler does not bind).
template <typename Binding>
auto BindPsumAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<xla::ffi::Span<const int64_t>>("leaf_keys")
      .template Attr<xla::ffi::Span<const int64_t>>("priorities")
      .template Attr<std::string_view>("names")
      .template Attr<int64_t>("partition_bytes")
      .template Attr<xla::ffi::Span<const int64_t>>("chunk_bytes")
      .template Attr<xla::ffi::Span<const int64_t>>("chunk_counts")
      .template Attr<xla::ffi::Span<const int32_t>>("chunk_alone")
      .template Attr<xla::ffi::Span<const int32_t>>("chunk_servers")
      .template Attr<std::string_view>("tree")
      .template Attr<int64_t>("tree_key");
}

// The part of a call's chunk table (attributes chunk_bytes, chunk_counts and
// chunk_alone: every chunk of one shard, operand by operand) that covers
// operands [first_op, first_op + num_ops), into spec; the index of its first
// chunk in *first_chunk. False, with *err, when the attributes do not add up.
inline bool TakeChunkTable(xla::ffi::Span<const int64_t> bytes, xla::ffi::Span<const int64_t> counts,
                           xla::ffi::Span<const int32_t> alone, size_t first_op, size_t num_ops, CallSpec* spec,
                           size_t* first_chunk, std::string* err) {
  if (bytes.size() != alone.size() || first_op + num_ops > counts.size()) {
    *err = "jbps_psum: the chunk table's attributes differ in length (" + std::to_string(bytes.size()) + " sizes, " +
           std::to_string(alone.size()) + " marks, " + std::to_string(counts.size()) + " counts)";
    return false;
  }
  size_t start = 0;
  for (size_t i = 0; i < first_op; ++i) start += static_cast<size_t>(counts[i]);
  size_t n = 0;
  for (size_t i = first_op; i < first_op + num_ops; ++i) {
    if (counts[i] < 0) {
      *err = "jbps_psum: a negative chunk count";
      return false;
    }
    spec->chunk_counts.push_back(static_cast<uint32_t>(counts[i]));
    n += static_cast<size_t>(counts[i]);
  }
  if (start + n > bytes.size()) {
    *err = "jbps_psum: the chunk table counts more chunks than it has sizes";
    return false;
  }
  for (size_t c = start; c < start + n; ++c) {
    if (bytes[c] < 1) {
      *err = "jbps_psum: a chunk of " + std::to_string(bytes[c]) + " bytes";
      return false;
    }
    spec->chunk_bytes.push_back(static_cast<uint64_t>(bytes[c]));
    spec->chunk_alone.push_back(alone[c] != 0);
  }
  *first_chunk = start;
  return true;
}

// jbps_join's body on any platform: every result aliases its operand, so
// copy(dst, src, bytes) runs only where XLA gave a result its own buffer.
// Operands past the results are only read.
template <typename Copy>
xla::ffi::Error JoinOperands(xla::ffi::RemainingArgs args, xla::ffi::RemainingRets rets, Copy copy) {
  namespace ffi = xla::ffi;
  // Operands past the results are only read: the join keeps them live until it runs.
  if (args.size() < rets.size())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jbps_join: fewer operands than results");
  for (size_t i = 0; i < rets.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value())
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jbps_join: operand " + std::to_string(i));
    if (in->untyped_data() == (*out)->untyped_data()) continue;
    std::string err = copy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
    if (!err.empty()) return ffi::Error(ffi::ErrorCode::kInternal, "jbps_join: " + err);
  }
  return ffi::Error::Success();
}

}  // namespace jbps
