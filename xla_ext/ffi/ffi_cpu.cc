// Operands: the device's shard index (int32 scalar), then one shard per tensor.
// Results: one summed shard per tensor, same shapes and dtypes.
// Attributes: leaf_keys (int64 per tensor, identical on every worker),
// priorities (int64 per tensor, larger sooner), names (tensor names, one per
// line), partition_bytes (int64, the largest chunk), the plan's chunk table
// of one shard: chunk_bytes (int64, every chunk, tensor by tensor),
// chunk_counts (int64, chunks per tensor), chunk_alone (int32, 1: never
// fused), then chunk_servers (int32, the server of every chunk: shard by
// shard, tensor by tensor, chunk by chunk),
// tree (the whole call's leaves, checked across workers by a server) and
// tree_key (int64, where that check meets).
//
// The handler hands everything to the engine and returns a Future, which the
// engine completes: no XLA thread waits on the network for long. A small
// call's handler first waits briefly for the sum itself (HandlerWait).
#include "ffi/ffi_cpu.h"

#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include "engine/engine.h"
#include "ffi/ffi_operand.h"
#include "ffi/fresh_output.h"
#include "ffi/handler_wait.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jbps {
namespace {

// Calls of at most this many bytes (all operands), with every server on this
// host, wait in the handler (HandlerWait): up to kHandlerSpinNs polling, up
// to kHandlerWaitNs in all. Such a call takes a few hundred microseconds at
// most when the workers are in step.
constexpr size_t kHandlerWaitBytes = size_t{1} << 20;
constexpr int64_t kHandlerSpinNs = 100'000;
constexpr int64_t kHandlerWaitNs = 1'000'000;

ffi::Future Failed(std::string msg) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(ffi::Error(ffi::ErrorCode::kInvalidArgument, std::move(msg)));
  return future;
}

ffi::Future PsumCpu(ffi::Buffer<ffi::S32> shard_index, ffi::RemainingArgs args, ffi::RemainingRets rets,
                    ffi::Span<const int64_t> leaf_keys, ffi::Span<const int64_t> priorities, std::string_view names,
                    int64_t partition_bytes, ffi::Span<const int64_t> chunk_bytes,
                    ffi::Span<const int64_t> chunk_counts, ffi::Span<const int32_t> chunk_alone,
                    ffi::Span<const int32_t> chunk_servers, std::string_view tree, int64_t tree_key) {
  const size_t n = args.size();
  if (rets.size() != n || leaf_keys.size() != n || priorities.size() != n)
    return Failed("jbps_psum: operand, result and attribute counts differ (" + std::to_string(n) + ", " +
                  std::to_string(rets.size()) + ", " + std::to_string(leaf_keys.size()) + ")");
  if (partition_bytes < 1) return Failed("jbps_psum: partition_bytes must be positive");
  CallSpec spec;
  spec.shard = static_cast<uint32_t>(*shard_index.typed_data());
  spec.names = std::string(names);
  spec.tree = std::string(tree);
  spec.tree_key = static_cast<uint64_t>(tree_key);
  spec.partition_bytes = static_cast<size_t>(partition_bytes);
  spec.operands.resize(n);
  size_t first_chunk = 0;
  std::string table_err;
  if (!TakeChunkTable(chunk_bytes, chunk_counts, chunk_alone, 0, n, &spec, &first_chunk, &table_err))
    return Failed(table_err);
  const size_t chunks_per_shard = spec.chunk_bytes.size();
  for (size_t i = 0; i < n; ++i) {
    Operand& op = spec.operands[i];
    std::string err = DescribeOperand(i, args.get<ffi::AnyBuffer>(i), rets.get<ffi::AnyBuffer>(i), leaf_keys[i],
                                      priorities[i], &op, &op.in, &op.out);
    if (!err.empty()) return Failed(err);
    if (op.out != op.in && Engine::Get().huge_pages()) PrepareFreshOutput(op.out, op.nbytes);  // a fresh buffer
  }
  const size_t first = static_cast<size_t>(spec.shard) * chunks_per_shard;
  if (first + chunks_per_shard > chunk_servers.size())
    return Failed("jbps_psum: the plan routes " + std::to_string(chunk_servers.size()) + " chunks, too few for shard " +
                  std::to_string(spec.shard) + " of " + std::to_string(chunks_per_shard) + " chunks each");
  spec.servers.assign(chunk_servers.begin() + first, chunk_servers.begin() + first + chunks_per_shard);
  // The plan routes every local device's shard: one call per device each step.
  if (chunks_per_shard > 0) spec.slots = static_cast<uint32_t>(chunk_servers.size() / chunks_per_shard);
  if (Engine::Get().rehearsal() > 0) {  // a newcomer's warm-up runs its step: the result is thrown away
    for (const Operand& op : spec.operands)
      if (op.out != op.in) std::memcpy(op.out, op.in, op.nbytes);
    ffi::Promise done;
    ffi::Future future(done);
    done.SetAvailable();
    return future;
  }
  size_t call_bytes = 0;
  for (const Operand& op : spec.operands) call_bytes += op.nbytes;
  ffi::Promise promise;
  ffi::Future future(promise);
  auto shared = std::make_shared<ffi::Promise>(std::move(promise));
  auto settle = [shared](const std::string& error) {
    if (error.empty()) {
      shared->SetAvailable();
    } else {
      shared->SetError(ffi::Error(ffi::ErrorCode::kUnavailable, error));
    }
  };
  if (call_bytes > kHandlerWaitBytes || !Engine::Get().all_servers_local()) {
    Engine::Get().Submit(std::move(spec), settle);
    return future;
  }
  auto wait = std::make_shared<HandlerWait>();
  Engine::Get().Submit(std::move(spec), settle, [wait](const std::string& error) { return wait->Offer(error); });
  if (wait->Wait(kHandlerSpinNs, kHandlerWaitNs)) settle(wait->error());
  return future;
}

// jbps_join: every operand is its result (aliased), so there is nothing to do
// unless XLA gave a result its own buffer. Its purpose is the schedule: the
// sums of a psum's buckets all pass through one join, so each stays live
// until the last bucket's call, and XLA cannot hand a bucket's buffer to the
// rest of the backward pass while that bucket is still on the network (the
// executor would make that work wait for the sum).
ffi::Error JoinCpu(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return JoinOperands(args, rets, [](void* dst, const void* src, size_t n) {
    std::memcpy(dst, src, n);
    return std::string();
  });
}

// jbps_workers: the running job's worker count (int32 scalar), read when the
// program runs rather than baked in when it was traced: an elastic job's mean
// divides by it, so that its programs are the same for every membership.
ffi::Error WorkersCpu(ffi::Result<ffi::BufferR0<ffi::S32>> out) {
  uint32_t n = Engine::Get().rehearsal();  // set only while no engine runs
  if (n == 0) n = Engine::Get().num_workers();
  if (n == 0) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "jbps: the engine is not running");
  *out->typed_data() = static_cast<int32_t>(n);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbpsJoinCpu, JoinCpu, ffi::Ffi::Bind().RemainingArgs().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbpsWorkersCpu, WorkersCpu, ffi::Ffi::Bind().Ret<ffi::BufferR0<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JbpsPsumCpu, PsumCpu, BindPsumAttrs(ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().RemainingArgs().RemainingRets()));

}  // namespace jbps
