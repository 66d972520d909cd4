// The engine's own types, shared by its files and by nothing else (engine.h
// is the interface). One psum call of one device (Call) is cut into chunks
// (Chunk); chunks wait in the priority queue, move under the credit window to
// their server's connection (ServerConn), and their sums complete the call.
// Who does what:
//   engine.cc            start, stop, submit: the orchestration
//   engine_chunking.cc   keys, chunk sizes, fusion of small chunks
//   engine_scheduler.cc  the priority queue, the credit window, send queues
//   engine_link.cc       a server connection: its sender, receiver and shared memory
//   engine_calls.cc      a call's lifetime: completion, failure, deadlines, trace
//   engine_siblings.cc   a step's calls on the local devices complete together
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <queue>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "common/log.h"
#include "common/steady_clock.h"
#include "common/thread_name.h"
#include "engine/credit_queue.h"
#include "engine/engine.h"
#include "kernels/stream_copy.h"
#include "transport/net.h"
#include "transport/transport.h"
#include "wire/frame.h"
#include "wire/protocol.h"

namespace jbps {

using Clock = std::chrono::steady_clock;

inline constexpr size_t kMaxTraceRecords = 1 << 21;
inline constexpr size_t kMaxStageRecords = 1 << 16;
// Fusion (FuseSmallChunks): chunks up to a quarter of the partition are
// small; a fused message holds at most a partition and this many of them
// (an iovec each on TCP, well under IOV_MAX).
inline constexpr size_t kSmallChunkDivisor = 4;
inline constexpr size_t kMaxFusedParts = 256;
// Shared-memory push slots per credit, and how long a push waits for one to
// come free before it goes over TCP instead.
inline constexpr size_t kSlotsPerCredit = 4;
inline constexpr int kSlotWaitMs = 20;
// A thread that queues pushes writes them itself when their connection is
// idle, sparing the connection's sender a wake-up: pushes copied into
// shared memory up to kDirectCopyBytes on one connection (the others' senders
// copy theirs meanwhile) and up to kDirectSmallBytes on each of the others;
// pushes over TCP up to kDirectSmallBytes, which a socket's buffer takes at
// once. Larger ones go to the sender threads, so the submitting XLA thread
// never waits long on the network.
inline constexpr size_t kDirectCopyBytes = 1 << 20;
inline constexpr size_t kDirectSmallBytes = 64 << 10;
// Messages one write takes from a connection's send queue, and the iovecs
// it may gather (Linux's IOV_MAX is 1024; a fused push over TCP alone takes
// one per part plus its header, at most kMaxFusedParts + 1).
inline constexpr size_t kMaxSendBatch = 64;
inline constexpr size_t kMaxSendIovecs = 512;
// A receiver waiting for the sum of a lone push it sent through shared
// memory (one push awaits its answer on the connection: a small call) polls
// its socket this long before it sleeps: a server on this host answers
// within microseconds, and a wake-up costs about as much. Pipelines of many
// chunks do not poll: there the CPU is better spent copying and summing.
inline constexpr int64_t kReceiverSpinNs = 50'000;

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline void RaiseTo(std::atomic<uint32_t>& value, uint32_t to) {
  uint32_t now = value.load();
  while (now < to && !value.compare_exchange_weak(now, to)) {
  }
}

inline double NowMicros() {
  return std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Which psum a call belongs to, the same for its calls on every device: its
// tree's key, or its first tensor's without a tree (lines and device groups).
inline uint64_t PsumKey(const CallSpec& spec) {
  return spec.tree.empty() && !spec.operands.empty() ? spec.operands[0].base_key : spec.tree_key;
}

inline std::string FormatSeconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

// One psum call of one device: its chunks complete it; any failure fails it.
// XLA owns the input/output memory until `done` runs, so every thread that
// touches that memory holds an I/O reference, and `done` runs only after the
// last one is released. A failed call refuses new references, which is what
// stops late sums from being written into freed buffers.
struct Call {
  Engine::Impl* engine = nullptr;
  uint64_t id = 0;
  CallSpec spec;
  DoneFn done;
  EarlyDoneFn early;
  Clock::time_point deadline;
  size_t total_chunks = 0;
  std::atomic<bool> failed{false};

  std::mutex mu;
  int io_refs = 1;  // the base reference, dropped on success or failure
  bool base_released = false;
  size_t remaining = 0;
  size_t dispatched = 0;  // chunks out of the priority queue, guarded by Engine::Impl::mu
  std::string error;
  // A call with a tree check: a tensor's error that says the workers' trees
  // differ waits for the check's own error, which names both workers'
  // leaves; the call's deadline bounds the wait (TimeoutMessage then gives it).
  bool tree_pending = false;
  std::string deferred;
  // The tree check's own error, set with tree_pending cleared: a tensor's error read on
  // another connection's thread between the two takes it instead of its own.
  std::string tree_error;
  // A server's word that some workers have not pushed one of this call's
  // chunks (kStall): what the call's timeout then says.
  std::string stalled;
  RoundKey tree_round{0, 0};  // the tree check's key and round, while pending
  // Its line (a psum's calls on one device; 0: none, routes never change) and
  // the latest route epoch its sums carried.
  uint64_t line = 0;
  std::atomic<uint32_t> routes_seen{0};
  // Which of its psum's calls on this device it is (engine_siblings.cc).
  uint64_t sibling_seq = 0;
  // Stage stamps (Engine::SetStageTiming), guarded by mu.
  bool timed = false;
  StageRecord stage;

  bool TryAcquire() {
    std::lock_guard<std::mutex> lock(mu);
    if (base_released) return false;
    ++io_refs;
    return true;
  }

  std::string TensorName(int op) const {
    size_t start = 0;
    for (int i = 0; i < op; ++i) {
      start = spec.names.find('\n', start);
      if (start == std::string::npos) return "#" + std::to_string(op);
      ++start;
    }
    size_t end = spec.names.find('\n', start);
    std::string name = spec.names.substr(start, end == std::string::npos ? std::string::npos : end - start);
    return name.empty() ? "#" + std::to_string(op) : name;
  }
};
using CallPtr = std::shared_ptr<Call>;

// A piece of one operand that a chunk carries.
struct Part {
  int op = 0;
  size_t offset = 0;
  size_t nbytes = 0;
};

struct Chunk {
  CallPtr call;
  int op = 0;                 // the (first) operand it carries: its dtype, its name in errors
  DType dtype = DType::kF32;  // its operand's (fused chunks share one)
  uint16_t param = 0;         // its operand's dtype parameter (fused chunks share one)
  std::vector<Part> parts;    // one, or several small ones fused into one message
  size_t nbytes = 0;          // of all parts
  int slot = -1;              // the shared-memory push slot it occupies until acknowledged
  uint64_t key = 0;
  uint32_t round = 0;
  int server = 0;
  int64_t priority = 0;
  uint64_t seq = 0;
  bool skipped = false;  // never sent (its call failed first)
  bool alone = false;    // never fused (the call's chunk table says so)
  bool tree = false;     // the call's tree check (kTree), not data
  std::string payload;   // a tree check's: its digest, then its description when the server has not seen it
  ChunkTimes times;      // set only when tracing
};
using ChunkPtr = std::shared_ptr<Chunk>;

// Highest priority first; first submitted first among equals.
struct ChunkOrder {
  bool operator()(const ChunkPtr& a, const ChunkPtr& b) const {
    if (a->priority != b->priority) return a->priority < b->priority;
    return a->seq > b->seq;
  }
};

struct ServerConn {
  int index = 0;
  HostPort addr;
  int fd = -1;
  uint64_t instance = 0;  // the server's, from its hello reply: names its shared-memory socket
  // Where pushes' and sums' bytes travel (transport/transport.h): TCP, or
  // shared memory with a server on this host (AttachShm), with slots.
  std::unique_ptr<Transport> transport = std::make_unique<TcpTransport>();
  // Guarded by Engine::Impl::mu. A slot is the server's from its push until
  // the round's sum or error arrives (the server sums from it in place);
  // never freed by a local failure, since the server may still read it.
  std::vector<int> free_slots;
  std::unordered_map<RoundKey, int, RoundKeyHash> slot_of;
  std::condition_variable slot_cv;  // a slot came free
  // A wait for a slot ran out: until one comes free, pushes that find none go
  // over TCP at once instead of each waiting again (with several calls in
  // flight the other workers may push these keys much later, and a wait per
  // push would pace the connection at one push per kSlotWaitMs).
  bool slots_starved = false;
  // The sender's pushes and the receiver's releases share the socket.
  std::mutex write_mu;
  std::atomic<uint64_t> bytes_pushed{0};
  std::atomic<int> awaiting{0};  // pushes written whose sum or error has not arrived
  std::atomic<uint64_t> bytes_pulled{0};
  // Guarded by Engine::Impl::mu.
  std::deque<ChunkPtr> sendq;
  std::deque<ChunkPtr> unacked;  // dispatched, in send order, awaiting kPushAck
  // How fast the server takes this worker's pushes: the time with some push to
  // it unacknowledged, and the bytes acknowledged (a push is acknowledged when
  // it arrives, so a slower link or a busier server shows as fewer bytes per
  // second, whatever the other workers do).
  int64_t unacked_since_ns = 0;
  uint64_t unacked_ns = 0;
  uint64_t bytes_acked = 0;
  uint64_t chunks_acked = 0;
  std::condition_variable send_cv;
  bool sending = false;  // a thread is writing chunks taken from sendq (one at a time keeps their order)
  bool bye = false;
  bool failed = false;
  bool aborted = false;  // the server ended the job (kAbort): its connection's close is no news
  // The tree descriptions this connection has sent, as the server keeps them
  // (kMaxDescribedTrees): a tree check of one of these sends its digest alone.
  std::unordered_set<uint64_t> described_trees;
  uint64_t described_tree_bytes = 0;
  std::thread sender;
  std::thread receiver;
};

// Runs `done` callbacks. XLA may continue the device's program inline in the
// thread that completes its future (and block there in a cross-device
// rendezvous), so each local device gets its own thread and no network thread
// ever runs user computation.
class Completer {
 public:
  Completer() : thread_([this] { Loop(); }) {}
  ~Completer() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      q_.push_back(std::move(fn));
    }
    cv_.notify_one();
  }

 private:
  void Loop() {
    NameThisThread("jbps-complete");
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !q_.empty(); });
      if (q_.empty()) return;  // stop requested and drained
      auto fn = std::move(q_.front());
      q_.pop_front();
      lock.unlock();
      fn();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool stop_ = false;
  std::thread thread_;
};

// Small chunks bound for one server fused into one message (engine_chunking.cc);
// *fused counts the chunks that went inside another.
std::vector<ChunkPtr> FuseSmallChunks(std::vector<ChunkPtr> chunks, size_t partition, uint32_t shard, uint64_t* fused);

// A call held back until its line's previous call completes (routes_can_change).
struct HeldCall {
  CallSpec spec;
  DoneFn done;
  EarlyDoneFn early;
  int64_t submitted = 0;  // SteadyNs() when stage timing, else 0
  uint64_t sibling_seq = 0;
};

// A completed call's result, on its way to the caller (Engine::Impl::Deliver).
struct Delivery {
  DoneFn done;
  EarlyDoneFn early;
  std::optional<StageRecord> stage;
  uint32_t shard = 0;
  std::string error;
};

// A psum's calls of one step on the local devices (CallSpec::slots): the
// k-th call of a psum on each device. Results wait here until every device's
// call is complete.
struct SiblingKey {
  uint64_t psum = 0;
  uint32_t slots = 0;
  uint64_t seq = 0;
  bool operator<(const SiblingKey& o) const { return std::tie(psum, slots, seq) < std::tie(o.psum, o.slots, o.seq); }
};
struct SiblingGroup {
  std::vector<Delivery> held;  // succeeded, waiting for the others
  std::vector<bool> arrived;   // by shard
  uint32_t count = 0;          // calls arrived
  std::string error;           // the first failure among them
  std::string name;            // the psum's first tensor, for the timeout's message
  Clock::time_point deadline;
};

// A psum's calls on one device: which route epoch the next one follows.
struct Line {
  bool busy = false;  // a call of it is in flight
  uint32_t epoch = 0;
  std::deque<HeldCall> held;
};

struct Engine::Impl {
  EngineOptions opt;
  int stall_ms = 60000;

  std::vector<ServerRole> roles;  // per connection, from the hello replies

  std::mutex mu;
  std::condition_variable watchdog_cv;
  bool running = false;
  bool stopping = false;
  std::string bye_reason;               // sent with the goodbyes (Stop)
  std::string fault;                    // first job-wide failure; see Engine::fault()
  std::atomic<bool> all_local{false};   // every server shares memory with this worker (while running)
  std::atomic<bool> huge_pages{false};  // opt.huge_pages, read by the handlers without mu
  // Chunks waiting by priority; out: dispatched, not yet acknowledged (at most opt.credit).
  CreditQueue<ChunkPtr, ChunkOrder> queue;
  std::unordered_map<RoundKey, ChunkPtr, RoundKeyHash> pending;  // sent or sending, sum not yet received
  std::unordered_map<uint64_t, uint32_t> next_round;
  std::map<uint64_t, CallPtr> active;  // by id: ids grow with deadlines
  // Wall time with at least one call in flight (the union, not the sum, of
  // overlapping calls): the communication share of a step, for users.
  Clock::time_point busy_since;
  std::atomic<uint64_t> busy_ns{0};
  void AddActive(const CallPtr& c);  // with mu held
  void EraseActive(uint64_t id);     // with mu held
  std::vector<std::unique_ptr<ServerConn>> conns;
  uint64_t next_call_id = 1;
  uint64_t next_seq = 0;
  std::thread watchdog;

  std::mutex trace_mu;
  std::vector<TraceRecord> trace;

  std::atomic<bool> stage_timing{false};
  std::mutex stages_mu;
  std::vector<StageRecord> stages;

  // Route epochs (SetRoutes): each epoch's shares, and every line's state.
  std::atomic<bool> routes_can_change{false};
  std::mutex lines_mu;
  std::map<uint32_t, std::vector<double>> route_fractions;
  // SetDealtSplit's shares, normalized (a lock of its own, never held while
  // taking another); cleared at Start.
  std::mutex dealt_mu;
  std::vector<double> dealt_fractions;
  // Engine::SetRehearsal's workers, read by the handlers without mu.
  std::atomic<uint32_t> rehearsal{0};
  std::atomic<uint32_t> num_workers{0};  // options.num_workers, for jbps_workers
  uint32_t routes_announced = 0;
  std::atomic<uint32_t> routes_used{0};
  std::unordered_map<uint64_t, Line> lines;
  void SubmitInLine(HeldCall call);
  void Launch(HeldCall held, uint64_t line, uint32_t epoch);
  void NextInLine(uint64_t line, uint32_t seen);

  std::mutex completer_mu;
  std::unordered_map<uint32_t, std::unique_ptr<Completer>> completers;

  // Per-device calls of one step (engine_siblings.cc): each psum's next
  // call number on each device, and the steps some device has not completed.
  std::mutex siblings_mu;
  std::map<std::pair<uint64_t, uint32_t>, std::vector<uint64_t>> sibling_next;
  std::map<SiblingKey, SiblingGroup> siblings;
  // Now plus the psum timeout: a call's deadline, and a step's wait for its devices.
  Clock::time_point DeadlineFromNow() const {
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt.timeout_s));
  }
  void NumberSibling(HeldCall* held);
  void ArriveSibling(Call* c, Delivery d);
  void Deliver(Delivery d);
  // The earliest deadline of a step still waiting for a device (watchdog).
  std::optional<Clock::time_point> NextSiblingDeadline();
  // Fails the steps past their deadline, or all with `all` (Stop).
  void ExpireSiblings(bool all, const std::string& why);

  std::atomic<uint64_t> calls{0}, calls_failed{0}, chunks_pushed{0}, bytes_pushed{0}, bytes_pulled{0}, bytes_shm{0},
      chunks_fused{0};

  // A call whose chunk was bound for a server that is gone.
  struct Lost {
    CallPtr call;
    int server;
  };
  std::vector<Lost> DispatchLocked(bool wake_senders = true);
  void WakeSendersLocked();
  void QueueTreeCheck(const ChunkPtr& tree);
  std::vector<ChunkPtr> TakeSendable(ServerConn* sc, size_t direct_budget, std::unique_lock<std::mutex>* lock);
  std::vector<std::pair<ServerConn*, std::vector<ChunkPtr>>> TakeDirectSends();
  bool WriteChunks(ServerConn* sc, std::vector<ChunkPtr>& batch);
  void FailLost(const std::vector<Lost>& lost);
  void SendLoop(ServerConn* sc);
  void RecvLoop(ServerConn* sc);
  void WatchdogLoop();

  void ReleaseIo(Call* c);
  void ChunkDone(Call* c);
  void FailCall(const CallPtr& c, const std::string& msg);
  void Complete(Call* c);
  void Record(const Chunk& ch, double pulled);
  void StampSum(Call* c, const FrameHeader& h, int64_t header_read);
  void KeepStage(StageRecord stage, int64_t done);
  void ConnFailed(ServerConn* sc, const std::string& why);
  void SetFault(const std::string& msg, bool said_by_server = false);
  void DropSkipped(ServerConn* sc);
  // With mu held: a push of sc acknowledged (its credit back); false when it was not waiting for one.
  bool AckLocked(ServerConn* sc, const RoundKey& rk);
  // The receiver's handling of a round's answer (engine_link.cc).
  ChunkPtr TakeAnswered(ServerConn* sc, const Frame& f);
  bool OnError(ServerConn* sc, const Frame& f, std::string* why);
  void OnAbort(ServerConn* sc, const std::string& msg);
  void OnStall(ServerConn* sc, const Frame& f);
  bool OnSum(ServerConn* sc, const Frame& f, FrameReader* reader, std::string* why);
  void AttachShm(ServerConn* sc);
  IoStatus SendRelease(ServerConn* sc, const FrameHeader& sum);
  std::string TimeoutMessage(const CallPtr& c);
};

}  // namespace jbps
