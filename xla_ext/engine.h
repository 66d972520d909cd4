// The worker engine: one per worker process. It takes the shards of every
// psum call of every local device, cuts them into chunks, pushes the chunks to
// their servers in priority order under a credit window, and receives each
// chunk's sum straight into the call's output buffer.
//
// Threads: a sender and a receiver per server connection, a watchdog that
// fails calls past their deadline, and per-device completion threads. Chunks
// move from the priority queue to the per-server send queues (bounded by
// credits) on whichever thread queued them or freed a credit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtype.h"
#include "protocol.h"

namespace jbps {

struct EngineOptions {
  std::vector<std::string> servers;  // host:port of every summation server
  uint32_t rank = 0;
  uint32_t num_workers = 1;
  uint64_t token = 0;
  int credit = 4;          // chunks pushed but not yet acknowledged, per worker
  double timeout_s = 60;   // connect, and every psum call end to end
  bool trace = false;      // keep a TraceRecord of every chunk (JBPS_TRACE_DIR)
  // Use shared memory with servers on this host (JBPS_SHM); TCP otherwise.
  bool shm = true;
  // Bytes of each of the 4 x `credit` push slots in a shared region: pushes
  // larger than this (a partition size above it) go over TCP.
  size_t shm_slot_bytes = size_t{4} << 20;
};


struct EngineStats {
  uint64_t calls = 0;
  uint64_t calls_failed = 0;
  uint64_t chunks_pushed = 0;
  uint64_t bytes_pushed = 0;
  uint64_t bytes_pulled = 0;
  double busy_seconds = 0;  // wall time with at least one call in flight
  uint64_t bytes_shm = 0;     // of bytes_pushed + bytes_pulled, those moved through shared memory
  uint64_t chunks_fused = 0;  // small chunks sent inside another message (see FuseSmallChunks)
  uint64_t shm_servers = 0;   // servers reached through shared memory
  std::vector<uint64_t> server_bytes_pushed;  // of bytes_pushed, to each server in order
};

// One tensor shard of a call: `nbytes` read from `in`, the sum written to `out`.
struct Operand {
  const void* in = nullptr;
  void* out = nullptr;
  size_t nbytes = 0;
  DType dtype = DType::kF32;
  uint64_t base_key = 0;  // identical on every worker for the same tensor
  int64_t priority = 0;   // larger is sent sooner
};

// The plan fixes the chunking and each chunk's server (jbps/partition), so
// every worker cuts and routes the same tensor the same way.
struct CallSpec {
  std::vector<Operand> operands;
  uint32_t shard = 0;             // which local-device shard of each tensor this is
  std::string names;              // tensor names, one line per operand, for errors and traces
  size_t partition_bytes = 4 << 20;  // largest chunk; rounded down to whole elements
  std::vector<int32_t> servers;   // server of each chunk, operand by operand
  // The whole call's tree ("psum NAME" then "path dtype[shape]" per leaf).
  // Every worker sends it to one server under tree_key, which checks that
  // all sent the same: a tree that differs (a leaf more, another shape) fails
  // the call on every worker instead of summing what happens to line up.
  std::string tree;
  uint64_t tree_key = 0;
};

// The life of one chunk, in microseconds since the Unix epoch (so traces of
// several workers on one machine line up): submitted; taken by its
// connection's sender; acknowledged by the server (all bytes there); the
// sum's header arrived; the sum is in the output.
struct ChunkTimes {
  double queued = 0, sent_start = 0, acked = 0, sum_arrived = 0, pulled = 0;
};

// A traced chunk: what it was, and its ChunkTimes.
struct TraceRecord {
  uint64_t key = 0;
  uint32_t round = 0;
  uint32_t shard = 0;
  int server = 0;
  int64_t priority = 0;
  uint64_t nbytes = 0;
  std::string tensor;
  ChunkTimes times;
};

// Called exactly once, with an empty string on success or the error.
using DoneFn = std::function<void(const std::string& error)>;

class Engine {
 public:
  // The process-wide engine.
  static Engine& Get();

  bool Start(const EngineOptions& options, std::string* err);
  void Stop();
  // The credit window from now on (once the servers' roles, read at Start,
  // have decided the default); false with *err unless credit >= 1.
  bool SetCredit(int credit, std::string* err);
  bool running() const;
  // Why the job failed (a lost server, or a lost worker a server reported),
  // or empty. Set once; every pending and later call fails with it until Stop().
  std::string fault() const;
  EngineStats stats() const;
  std::vector<ServerRole> server_roles() const;
  // Chunks completed since the last call (empty unless options.trace).
  std::vector<TraceRecord> TakeTrace();
  // Bytes of every chunk but an operand's last: the partition size rounded
  // down to whole elements (at least one). jbps/partition/plan.py's
  // chunk_size is the same rule; the FFI handler checks the two agree.
  static size_t ChunkBytes(DType dtype, size_t partition_bytes);
  // Chunk count of an operand of `nbytes` under the call's partition size.
  static size_t NumChunks(size_t nbytes, DType dtype, size_t partition_bytes);

  // Never blocks on the network; `done` runs on a completion thread.
  void Submit(CallSpec spec, DoneFn done);

  struct Impl;

 private:
  Engine();
  std::shared_ptr<Impl> impl_;
};

// The key of chunk `chunk` of shard `shard` of a tensor: the same function on
// every worker, so the same data meets on the same server under the same key.
uint64_t ChunkKey(uint64_t base_key, uint32_t shard, uint32_t chunk);

}  // namespace jbps
