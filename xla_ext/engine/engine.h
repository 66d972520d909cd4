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
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "wire/protocol.h"

namespace jbps {

struct EngineOptions {
  std::vector<std::string> servers;  // host:port of every summation server
  uint32_t rank = 0;
  uint32_t num_workers = 1;
  uint64_t token = 0;
  int credit = 4;         // chunks pushed but not yet acknowledged, per worker
  double timeout_s = 60;  // connect, and every psum call end to end
  bool trace = false;     // keep a TraceRecord of every chunk (JBPS_TRACE_DIR)
  // Use shared memory with servers on this host (JBPS_SHM); TCP otherwise.
  bool shm = true;
  // Bytes of each of the 4 x `credit` push slots in a shared region: pushes
  // larger than this (a partition size above it) go over TCP.
  size_t shm_slot_bytes = size_t{4} << 20;
  // Back fresh output buffers with huge pages (JBPS_HUGE_PAGES; fresh_output.h).
  bool huge_pages = true;
  // The job may re-plan its split while it runs (SetRoutes). A psum's calls
  // on one device (a line) then go one at a time, each routed by the route
  // epoch its line's previous call's sums carried: the same on every worker.
  bool routes_can_change = false;
};

struct EngineStats {
  uint64_t calls = 0;
  uint64_t calls_failed = 0;
  uint64_t chunks_pushed = 0;
  uint64_t bytes_pushed = 0;
  uint64_t bytes_pulled = 0;
  double busy_seconds = 0;                     // wall time with at least one call in flight
  uint64_t bytes_shm = 0;                      // of bytes_pushed + bytes_pulled, those moved through shared memory
  uint64_t chunks_fused = 0;                   // small chunks sent inside another message (see FuseSmallChunks)
  uint64_t shm_servers = 0;                    // servers reached through shared memory
  std::vector<uint64_t> server_bytes_pushed;   // of bytes_pushed, to each server in order
  std::vector<uint64_t> server_bytes_pulled;   // of bytes_pulled, from each server
  std::vector<uint64_t> server_bytes_acked;    // pushed bytes each server acknowledged
  std::vector<uint64_t> server_chunks_acked;   // and the pushes they came in
  std::vector<double> server_unacked_seconds;  // wall time with a push to the server not yet acknowledged
  std::vector<uint8_t> server_shared_memory;   // 1 where the server is reached through shared memory
  uint32_t routes_announced = 0;               // the latest route epoch SetRoutes announced
  uint32_t routes_used = 0;                    // the latest route epoch a call was routed by
};

// One tensor shard of a call: `nbytes` read from `in`, the sum written to `out`.
struct Operand {
  const void* in = nullptr;
  void* out = nullptr;
  size_t nbytes = 0;
  DType dtype = DType::kF32;
  uint16_t param = 0;     // the dtype's (dtype.h): topk's values per record, from the operand's shape
  uint64_t base_key = 0;  // identical on every worker for the same tensor
  int64_t priority = 0;   // larger is sent sooner
};

// The plan (jbps/partition/plan.py) cuts every operand into chunks and
// routes each chunk; the engine only walks the table it is given, so every
// worker cuts and routes the same tensor the same way, and nothing here
// repeats the rule.
struct CallSpec {
  std::vector<Operand> operands;
  uint32_t shard = 0;  // which local-device shard of each tensor this is
  std::string names;   // tensor names, one line per operand, for errors and traces
  // Bytes of every chunk, operand by operand, and how many chunks each operand
  // has; a chunk marked alone is never fused with others (the pieces at a large
  // shard's ends across hosts, which are small so that they go sooner).
  std::vector<uint64_t> chunk_bytes;
  std::vector<uint32_t> chunk_counts;
  std::vector<uint8_t> chunk_alone;
  size_t partition_bytes = 4 << 20;  // the largest chunk: chunks up to a quarter of it are fused
  std::vector<int32_t> servers;      // server of each chunk, operand by operand
  // The whole call's tree ("psum NAME" then "path dtype[shape]" per leaf).
  // Every data push carries its digest, and a server sums no round whose
  // pushes' digests differ. Every worker also sends the digest to one server
  // under tree_key (with the description the first time), which checks that
  // all sent the same: a tree that differs (a leaf more, another shape) fails
  // the call on every worker, naming the leaf, even where no chunk lines up.
  std::string tree;
  uint64_t tree_key = 0;
  uint64_t tree_digest = 0;  // TreeDigest(tree), filled in by Submit when 0; calls of
                             // one tree split into several (the CUDA handler) share it
  // Routed by `servers` whatever split a route epoch announced (SetRoutes):
  // the rate follower's probe of a server its split leaves without bytes.
  bool fixed_routes = false;
  // The worker's local devices that each make this call with a shard of their
  // own (shard < slots): their calls of one step complete together, and fail
  // together when one fails (engine_siblings.cc).
  uint32_t slots = 1;
};

// A 64-bit digest of a tree description, the same on every worker.
uint64_t TreeDigest(std::string_view tree);

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

// When one call went through each stage (SetStageTiming), for the
// benchmark's latency breakdown: SteadyNs() stamps, 0 where a stage did not
// happen. A call's last data chunk decides pushed, sum_arrived and pulled.
struct StageRecord {
  std::string name;          // the call's first tensor
  uint64_t bytes = 0;        // of all its operands
  int64_t submitted = 0;     // the handler handed the call to the engine
  int64_t pushed = 0;        // the push is about to be written to its socket (copied in, if in shared memory)
  int64_t sum_arrived = 0;   // the sum's header was read
  int64_t pulled = 0;        // the sum is in the output
  int64_t tree_checked = 0;  // the tree check's answer was read
  int64_t done = 0;          // the result was handed to the caller (a waiting handler, or the completion thread)
  int64_t server_ns = 0;     // on the sum's server: the round's last push read -> the sum written
  int64_t peer_wait_ns = 0;  // on that server: this worker's push read -> the last push read
  bool failed = false;
};

// Called exactly once, with an empty string on success or the error.
using DoneFn = std::function<void(const std::string& error)>;
// Called first, on the engine thread that completes the call (see Submit);
// true means it took the result and `done` is not called.
using EarlyDoneFn = std::function<bool(const std::string& error)>;

class Engine {
 public:
  // The process-wide engine.
  static Engine& Get();

  bool Start(const EngineOptions& options, std::string* err);
  // `reason`: why this worker leaves, sent with its goodbye; empty for a
  // clean end. Servers end the job for the other workers when it is not.
  void Stop(const std::string& reason = "");
  // The credit window from now on (once the servers' roles, read at Start,
  // have decided the default); false with *err unless credit >= 1.
  bool SetCredit(int credit, std::string* err);
  bool running() const;
  // Whether every server shares memory with this worker (all on this host).
  bool all_servers_local() const;
  // options.huge_pages of the running engine.
  bool huge_pages() const;
  // options.num_workers of the running engine (0 before Start).
  uint32_t num_workers() const;
  // A rehearsal: a worker about to join an elastic job runs its step once
  // before it joins (jbps.elastic.run's warm_up), so that its programs' first
  // execution, slower than the next, is not the others' wait. While
  // `workers` > 0 and no engine runs, every psum call returns its operands
  // (nothing sent) and jbps_workers reads `workers`; 0 ends it. False with
  // *err while the engine runs; Start ends it.
  bool SetRehearsal(uint32_t workers, std::string* err);
  // The rehearsal's worker count, 0 when none runs.
  uint32_t rehearsal() const;
  // Why the job failed (a lost server, or a lost worker a server reported),
  // or empty. Set once; every pending and later call fails with it until Stop().
  std::string fault() const;
  EngineStats stats() const;
  std::vector<ServerRole> server_roles() const;
  // Chunks completed since the last call (empty unless options.trace).
  std::vector<TraceRecord> TakeTrace();
  // Stamps every call submitted from now on (and asks the servers to time
  // its rounds) until turned off; TakeStages returns the calls completed
  // since its last call (at most 65,536 kept).
  void SetStageTiming(bool on);
  std::vector<StageRecord> TakeStages();
  // A new split (each server's share of the bytes, in server order) from
  // now on: announced to every server as the next route epoch, which a
  // psum's calls follow once every worker has announced it (protocol.h,
  // kRoutes). Every worker must announce the same splits in the same order.
  // Returns the epoch, or 0 with *err (not running, routes_can_change off,
  // or shares that are not one finite, non-negative number per server).
  // Not while Stop runs: the caller orders them (jbps/replan.py's lock).
  uint32_t SetRoutes(const std::vector<double>& fractions, std::string* err);
  // The split (a share per server) by which the chunks of a call whose
  // program routes them to no server (server -1) are dealt: an elastic job's,
  // whose programs must not depend on the membership they were traced in, so
  // that a later generation's are the same and come from the compilation
  // cache. False with *err unless one non-negative share per server, some > 0.
  bool SetDealtSplit(const std::vector<double>& fractions, std::string* err);
  // Why `spec`'s chunk table cannot cut its operands (its counts, sizes and
  // routes must add up, and every chunk hold whole elements), or empty.
  static std::string CheckChunkTable(const CallSpec& spec);

  // Never blocks on the network; `done` runs on a completion thread (one
  // per local device: XLA may go on with the device's program in it). With
  // `early`, the thread that completes the call (a receiver, the watchdog,
  // this one) offers it the result first: a caller waiting for the call
  // takes it there, without the completion thread's hand-off.
  void Submit(CallSpec spec, DoneFn done, EarlyDoneFn early = nullptr);

  struct Impl;

 private:
  Engine();
  std::shared_ptr<Impl> impl_;
};

// The server of each chunk of `spec`'s table for the shares `fractions`:
// dealt in the order the engine sends them (priority, then position), each to
// the server furthest below its share of the bytes dealt so far (as
// jbps/partition/assign.py deals a plan's), so identical on every worker.
std::vector<int32_t> DealChunks(const CallSpec& spec, const std::vector<double>& fractions);

// The key of chunk `chunk` of shard `shard` of a tensor: the same function on
// every worker, so the same data meets on the same server under the same key.
uint64_t ChunkKey(uint64_t base_key, uint32_t shard, uint32_t chunk);

}  // namespace jbps
