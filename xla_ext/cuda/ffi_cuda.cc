// jbps_psum on CUDA. Same operands, results and attributes as ffi_cpu.cc.
//
// Everything is ordered on XLA's stream and the launching thread returns at
// once. Per tensor i, in stream order:
//   D2H shard index            (once, into pinned memory; the engine keys by it)
//   D2H tensor i -> pinned in_i, host function: submit tensor i to the engine
//   ... for every tensor, so D2H of i+1 overlaps the network of i ...
//   wait until word_i == 1     (cuStreamWaitValue32; the engine's done sets it)
//   H2D pinned out_i -> result i  (overlaps later tensors still pulling)
//   host function: return staging buffers and words to their pools
//
// Engine errors arrive after the handler has returned, when XLA can no longer
// fail this op: they are kept and fail the next jbps_psum on CUDA ("an earlier
// psum failed"). JBPS_CUDA_SYNC=1 instead waits inside the handler, so the op
// itself fails, at the cost of holding the launching thread for the round trip.
#include "cuda/ffi_cuda.h"

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "cuda/cuda_staging.h"
#include "cuda/cuda_stream_wait.h"
#include "engine/engine.h"
#include "ffi/ffi_operand.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jbps {
namespace {

std::atomic<double> g_timeout_s{60.0};

// The first engine error since the last jbps_psum on CUDA started.
std::mutex g_deferred_mu;
std::string g_deferred_error;

void Defer(const std::string& error) {
  std::lock_guard<std::mutex> lock(g_deferred_mu);
  if (g_deferred_error.empty()) g_deferred_error = error;
}

std::string TakeDeferred() {
  std::lock_guard<std::mutex> lock(g_deferred_mu);
  std::string e;
  e.swap(g_deferred_error);
  return e;
}

bool EnvIsOne(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string_view(v) == "1";
}

// How long the handler's own waits may take: the engine's timeout starts only
// when the stream reaches the submit, so allow the stream time to get there.
std::chrono::duration<double> WaitBound() { return std::chrono::duration<double>(g_timeout_s.load() + 30.0); }

struct CallState;

struct TensorState {
  CallState* call = nullptr;
  Operand op;  // in/out: the pinned staging buffers
  std::string name;
  size_t first_chunk = 0;  // within the shard's chunk routing
  size_t num_chunks = 0;
  CompletionWord word;  // unused by the host-function fallback
  // Staging buffers and word go back to the pools when both the engine is
  // done (it may still write `out`) and the stream is done with them.
  bool finished = false, released = false;
  std::string error;
};

struct CallState {
  int32_t* shard_host = nullptr;  // pinned
  std::vector<int32_t> chunk_servers;
  size_t chunks_per_shard = 0;
  size_t partition_bytes = 0;
  CallSpec table;  // the plan's chunk table of one shard (chunk_bytes, chunk_counts, chunk_alone)
  // The call's tree check travels with the first tensor that has bytes (the
  // engine sends it beside that tensor's chunks); every tensor's pushes carry
  // the tree's digest, so no tensor of a mismatched call is summed.
  std::string tree;
  uint64_t tree_key = 0;
  uint64_t tree_digest = 0;
  const TensorState* tree_carrier = nullptr;
  bool sync = false;
  std::vector<std::unique_ptr<TensorState>> tensors;  // stable addresses for host functions
  std::mutex mu;
  std::condition_variable cv;
  size_t pending = 0;
  // The stream's reference, dropped by the last host function.
  std::shared_ptr<CallState>* stream_ref = nullptr;
};

void ReturnTensorResources(TensorState* t) {
  ReleaseStaging(const_cast<void*>(t->op.in), t->op.nbytes);
  ReleaseStaging(t->op.out, t->op.nbytes);
  ReleaseCompletionWord(t->word);
  t->op.in = t->op.out = nullptr;
  t->word = {};
}

// The engine's done for tensor t (or the submit's own failure).
void Finish(TensorState* t, const std::string& error) {
  CallState* c = t->call;
  // Deferred before the word is set: once the stream has passed this tensor
  // (e.g. block_until_ready returned), the next psum sees the error.
  if (!error.empty() && !c->sync) Defer(error);
  if (t->word.host != nullptr) __atomic_store_n(t->word.host, 1u, __ATOMIC_RELEASE);
  std::lock_guard<std::mutex> lock(c->mu);
  t->finished = true;
  t->error = error;
  --c->pending;
  if (t->released) ReturnTensorResources(t);
  c->cv.notify_all();
}

// Host function (no CUDA calls allowed): the tensor is staged; hand it over.
void SubmitHostFn(void* arg) {
  auto* t = static_cast<TensorState*>(arg);
  CallState* c = t->call;
  const size_t shard = static_cast<size_t>(*c->shard_host);
  const size_t first = shard * c->chunks_per_shard + t->first_chunk;
  if (*c->shard_host < 0 || first + t->num_chunks > c->chunk_servers.size()) {
    Finish(t, "jbps: the plan routes " + std::to_string(c->chunk_servers.size()) + " chunks, too few for shard " +
                  std::to_string(*c->shard_host) + " of tensor " + t->name);
    return;
  }
  CallSpec spec;
  spec.shard = static_cast<uint32_t>(shard);
  spec.names = t->name;
  spec.partition_bytes = c->partition_bytes;
  spec.operands = {t->op};
  spec.chunk_counts = {static_cast<uint32_t>(t->num_chunks)};
  spec.chunk_bytes.assign(c->table.chunk_bytes.begin() + t->first_chunk,
                          c->table.chunk_bytes.begin() + t->first_chunk + t->num_chunks);
  spec.chunk_alone.assign(c->table.chunk_alone.begin() + t->first_chunk,
                          c->table.chunk_alone.begin() + t->first_chunk + t->num_chunks);
  spec.tree_digest = c->tree_digest;
  if (t == c->tree_carrier) {
    spec.tree = c->tree;
    spec.tree_key = c->tree_key;
  }
  spec.servers.assign(c->chunk_servers.begin() + first, c->chunk_servers.begin() + first + t->num_chunks);
  std::shared_ptr<CallState> keep = *c->stream_ref;  // until the engine is done
  Engine::Get().Submit(std::move(spec), [keep, t](const std::string& error) { Finish(t, error); });
}

// Host function, the fallback when the stream cannot wait on a word itself.
// It blocks CUDA's host-function thread (shared by the process's streams) for
// the network round trip, delaying other streams' host functions; the stream
// idles as it would anyway. Bounded: after the bound the results are garbage
// and the error is deferred.
void HostWaitFn(void* arg) {
  auto* t = static_cast<TensorState*>(arg);
  CallState* c = t->call;
  std::unique_lock<std::mutex> lock(c->mu);
  if (!c->cv.wait_for(lock, WaitBound(), [t] { return t->finished; })) {
    lock.unlock();
    Defer("jbps: psum of " + t->name + " not done within " + std::to_string(WaitBound().count()) +
          " s (host-function wait); its result was left unsummed");
  }
}

// Host function, last on the stream for the call.
void ReleaseHostFn(void* arg) {
  auto* ref = static_cast<std::shared_ptr<CallState>*>(arg);
  CallState* c = ref->get();
  {
    std::lock_guard<std::mutex> lock(c->mu);
    for (auto& t : c->tensors) {
      t->released = true;
      if (t->finished) ReturnTensorResources(t.get());
    }
  }
  ReleaseStaging(c->shard_host, sizeof(int32_t));
  delete ref;
}

ffi::Error CudaFailed(const char* what, const std::string& tensor, cudaError_t rc) {
  return ffi::Error::Internal(std::string("jbps_psum: ") + what + " of " + tensor +
                              " failed: " + cudaGetErrorString(rc));
}

std::vector<std::string> SplitLines(std::string_view s, size_t n) {
  std::vector<std::string> out;
  size_t start = 0;
  while (out.size() < n) {
    size_t end = s.find('\n', start);
    if (end == std::string_view::npos) end = s.size();
    out.emplace_back(s.substr(start, end - start));
    start = end < s.size() ? end + 1 : s.size();
  }
  return out;
}

ffi::Error PsumCuda(cudaStream_t stream, ffi::Buffer<ffi::S32> shard_index, ffi::RemainingArgs args,
                    ffi::RemainingRets rets, ffi::Span<const int64_t> leaf_keys, ffi::Span<const int64_t> priorities,
                    std::string_view names, int64_t partition_bytes, ffi::Span<const int64_t> chunk_bytes,
                    ffi::Span<const int64_t> chunk_counts, ffi::Span<const int32_t> chunk_alone,
                    ffi::Span<const int32_t> chunk_servers, std::string_view tree, int64_t tree_key) {
  std::string earlier = TakeDeferred();
  if (!earlier.empty()) return ffi::Error(ffi::ErrorCode::kUnavailable, "jbps: an earlier psum failed: " + earlier);
  const size_t n = args.size();
  if (rets.size() != n || leaf_keys.size() != n || priorities.size() != n)
    return ffi::Error::InvalidArgument("jbps_psum: operand, result and attribute counts differ (" + std::to_string(n) +
                                       ", " + std::to_string(rets.size()) + ", " + std::to_string(leaf_keys.size()) +
                                       ")");
  if (partition_bytes < 1) return ffi::Error::InvalidArgument("jbps_psum: partition_bytes must be positive");

  auto call = std::make_shared<CallState>();
  call->partition_bytes = static_cast<size_t>(partition_bytes);
  {
    size_t first = 0;
    std::string table_err;
    if (!TakeChunkTable(chunk_bytes, chunk_counts, chunk_alone, 0, n, &call->table, &first, &table_err))
      return ffi::Error::InvalidArgument(table_err);
  }
  call->chunk_servers.assign(chunk_servers.begin(), chunk_servers.end());
  call->tree = std::string(tree);
  call->tree_key = static_cast<uint64_t>(tree_key);
  call->tree_digest = call->tree.empty() ? 0 : TreeDigest(call->tree);
  call->sync = EnvIsOne("JBPS_CUDA_SYNC");
  std::vector<std::string> tensor_names = SplitLines(names, n);
  std::vector<const void*> device_in(n);
  std::vector<void*> device_out(n);
  for (size_t i = 0; i < n; ++i) {
    auto t = std::make_unique<TensorState>();
    t->call = call.get();
    t->name = tensor_names[i];
    std::string err = DescribeOperand(i, args.get<ffi::AnyBuffer>(i), rets.get<ffi::AnyBuffer>(i), leaf_keys[i],
                                      priorities[i], &t->op, &device_in[i], &device_out[i]);
    if (!err.empty()) return ffi::Error::InvalidArgument(err);
    t->first_chunk = call->chunks_per_shard;
    t->num_chunks = call->table.chunk_counts[i];
    call->chunks_per_shard += t->num_chunks;
    if (t->op.nbytes > 0) ++call->pending;
    if (t->op.nbytes > 0 && call->tree_carrier == nullptr) call->tree_carrier = t.get();
    call->tensors.push_back(std::move(t));
  }

  if (Engine::Get().rehearsal() > 0) {  // a newcomer's warm-up runs its step: the result is thrown away
    for (size_t i = 0; i < n; ++i) {
      const TensorState& t = *call->tensors[i];
      if (t.op.nbytes == 0 || device_out[i] == device_in[i]) continue;
      cudaError_t rc = cudaMemcpyAsync(device_out[i], device_in[i], t.op.nbytes, cudaMemcpyDeviceToDevice, stream);
      if (rc != cudaSuccess) return CudaFailed("the rehearsal's copy", t.name, rc);
    }
    return ffi::Error::Success();
  }
  std::string why_no_stream_wait;
  const bool stream_wait = StreamWaitAvailable(&why_no_stream_wait);
  // Pinned memory first, so a failure here leaves nothing on the stream.
  std::string err;
  bool ok = (call->shard_host = static_cast<int32_t*>(AcquireStaging(sizeof(int32_t), &err))) != nullptr;
  for (size_t i = 0; ok && i < n; ++i) {
    TensorState& t = *call->tensors[i];
    if (t.op.nbytes == 0) continue;
    ok = (t.op.in = AcquireStaging(t.op.nbytes, &err)) != nullptr && (t.op.out = AcquireStaging(t.op.nbytes, &err)) &&
         (!stream_wait || AcquireCompletionWord(&t.word, &err));
  }
  if (!ok) {
    for (auto& t : call->tensors) ReturnTensorResources(t.get());
    ReleaseStaging(call->shard_host, sizeof(int32_t));
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, err);
  }

  // From here on the stream may use the state, so a failure leaks it rather
  // than free memory a queued copy or host function still touches.
  call->stream_ref = new std::shared_ptr<CallState>(call);
  cudaError_t rc =
      cudaMemcpyAsync(call->shard_host, shard_index.typed_data(), sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
  if (rc != cudaSuccess) return CudaFailed("copying the shard index to the host", "the call", rc);
  for (size_t i = 0; i < n; ++i) {
    TensorState* t = call->tensors[i].get();
    if (t->op.nbytes == 0) continue;
    rc = cudaMemcpyAsync(const_cast<void*>(t->op.in), device_in[i], t->op.nbytes, cudaMemcpyDeviceToHost, stream);
    if (rc != cudaSuccess) return CudaFailed("the device-to-host copy", t->name, rc);
    rc = cudaLaunchHostFunc(stream, SubmitHostFn, t);
    if (rc != cudaSuccess) return CudaFailed("enqueuing the submit", t->name, rc);
  }
  for (size_t i = 0; i < n; ++i) {
    TensorState* t = call->tensors[i].get();
    if (t->op.nbytes == 0) continue;
    std::string wait_err;
    if (!stream_wait || !EnqueueStreamWait(stream, t->word.device, 1, &wait_err)) {
      rc = cudaLaunchHostFunc(stream, HostWaitFn, t);
      if (rc != cudaSuccess) return CudaFailed("enqueuing the host wait", t->name, rc);
    }
    rc = cudaMemcpyAsync(device_out[i], t->op.out, t->op.nbytes, cudaMemcpyHostToDevice, stream);
    if (rc != cudaSuccess) return CudaFailed("the host-to-device copy", t->name, rc);
  }
  rc = cudaLaunchHostFunc(stream, ReleaseHostFn, call->stream_ref);
  if (rc != cudaSuccess) return CudaFailed("enqueuing the release", "the call", rc);

  if (!call->sync) return ffi::Error::Success();
  // JBPS_CUDA_SYNC=1: hold this thread until the engine is done with every
  // tensor, so an error fails this op rather than the next one.
  std::unique_lock<std::mutex> lock(call->mu);
  if (!call->cv.wait_for(lock, WaitBound(), [&] { return call->pending == 0; }))
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, "jbps_psum: JBPS_CUDA_SYNC wait for the engine exceeded " +
                                                             std::to_string(WaitBound().count()) + " s");
  for (auto& t : call->tensors)
    if (!t->error.empty()) return ffi::Error(ffi::ErrorCode::kUnavailable, t->error);
  return ffi::Error::Success();
}

ffi::Error JoinCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return JoinOperands(args, rets, [stream](void* dst, const void* src, size_t n) {
    cudaError_t rc = cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream);
    return rc == cudaSuccess ? std::string() : std::string(cudaGetErrorString(rc));
  });
}

}  // namespace

void SetCudaWaitTimeout(double seconds) { g_timeout_s.store(seconds); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JbpsJoinCuda, JoinCuda, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().RemainingArgs().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbpsPsumCuda, PsumCuda,
                              BindPsumAttrs(ffi::Ffi::Bind()
                                                .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                .Arg<ffi::Buffer<ffi::S32>>()
                                                .RemainingArgs()
                                                .RemainingRets()));

}  // namespace jbps
