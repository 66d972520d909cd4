// The summation server: receives pushed chunks from every worker, adds them
// per (key, round), and sends each worker the sum once all have pushed.
//
// Threads: one acceptor, which also reads every new connection's hello (so
// connections that never authenticate cost no threads); a reader and a writer
// per worker connection; a fixed
// set of engine threads that own the per-key state (a key is bound to one
// engine thread when first seen, to the thread with the fewest bytes so far,
// so threads share the load by bytes and sums need no locks).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "wire/protocol.h"

namespace jbps {

struct ServerOptions {
  std::string bind = "127.0.0.1:0";  // host:port; port 0 picks a free one
  int num_workers = 1;
  uint64_t token = 0;
  int sum_threads = 0;      // 0: sized to the machine
  double timeout_s = 60;    // bound on a stalled frame or send
  bool keep_alive = false;  // keep serving after every worker said goodbye
  // Seconds from Start by which every worker must have connected, else the
  // job fails naming the absent ranks (a worker that died before connecting
  // would leave the server waiting forever). 0: no bound, for a server started
  // by hand that waits for its job; ignored when keep_alive.
  double join_timeout_s = 0;
  // Declared to workers in the hello reply; decides this server's byte share.
  ServerRole role = ServerRole::kColocated;
  // Add pushes in worker-rank order whatever their arrival order, so sums are
  // bitwise identical run to run (JBPS_DETERMINISTIC).
  bool deterministic = false;
  // Largest push a worker may announce; larger is a protocol error. Buffers
  // grow as bytes arrive, so a header alone never costs its claimed length.
  uint64_t max_payload_bytes = kMaxPayloadBytes;
  // Distinct keys the server binds to threads; a push of a new key beyond
  // this fails with an error instead of growing the map without bound.
  size_t max_keys = size_t{1} << 22;
  // Share memory with workers on this host (shm.h): sums are built in an
  // arena of this many bytes (virtual; pages are touched as sums need them),
  // which colocated workers map. 0 turns it off: TCP only.
  uint64_t shm_arena_bytes = uint64_t{1} << 30;
};

struct ServerStats {
  uint64_t pushes = 0;
  uint64_t bytes_received = 0;
  uint64_t sums_sent = 0;
  uint64_t rejected = 0;               // connections refused before or after their hello
  uint64_t workers_lost = 0;           // authenticated workers gone without a goodbye
  uint64_t bytes_shm = 0;              // pushed and summed bytes that crossed shared memory, not a socket
  uint64_t shm_workers = 0;            // workers connected through shared memory now
  std::vector<uint64_t> thread_bytes;  // bytes of the keys bound to each engine thread (one round each)
};

class SummationServer {
 public:
  explicit SummationServer(ServerOptions options);
  ~SummationServer();
  SummationServer(const SummationServer&) = delete;
  SummationServer& operator=(const SummationServer&) = delete;

  // Binds, listens and starts the threads. False with *err on failure.
  bool Start(std::string* err);
  int port() const;
  // Waits up to `seconds` for the job to end (every worker said goodbye, or
  // one was lost and the server is not keep-alive) or for Stop(); true when finished.
  bool WaitFor(double seconds);
  void Stop();
  ServerStats stats() const;
  // Why the job ended early (a worker lost), or empty.
  std::string failure() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace jbps
