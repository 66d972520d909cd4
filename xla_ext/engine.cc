#include "engine.h"

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
#include <unordered_map>
#include <unordered_set>

#include "log.h"
#include "net.h"
#include "protocol.h"
#include "shm.h"
#include "steady_clock.h"
#include "stream_copy.h"
#include "thread_name.h"

namespace jbps {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxTraceRecords = 1 << 21;
constexpr size_t kMaxStageRecords = 1 << 16;
// Fusion (FuseSmallChunks): chunks up to a quarter of the partition are
// small; a fused message holds at most a partition and this many of them
// (an iovec each on TCP, well under IOV_MAX).
constexpr size_t kSmallChunkDivisor = 4;
constexpr size_t kMaxFusedParts = 256;
// Shared-memory push slots per credit, and how long a push waits for one to
// come free before it goes over TCP instead.
constexpr size_t kSlotsPerCredit = 4;
constexpr int kSlotWaitMs = 20;
// A thread that queues pushes writes them itself when their connection is
// idle, sparing the connection's sender a wake-up: pushes copied into
// shared memory up to kDirectCopyBytes on one connection (the others' senders
// copy theirs meanwhile) and up to kDirectSmallBytes on each of the others;
// pushes over TCP up to kDirectSmallBytes, which a socket's buffer takes at
// once. Larger ones go to the sender threads, so the submitting XLA thread
// never waits long on the network.
constexpr size_t kDirectCopyBytes = 1 << 20;
constexpr size_t kDirectSmallBytes = 64 << 10;
// Messages one write takes from a connection's send queue, and the iovecs
// it may gather (Linux's IOV_MAX is 1024; a fused push over TCP alone takes
// one per part plus its header, at most kMaxFusedParts + 1).
constexpr size_t kMaxSendBatch = 64;
constexpr size_t kMaxSendIovecs = 512;
// A receiver waiting for the sum of a lone push it sent through shared
// memory (one push awaits its answer on the connection: a small call) polls
// its socket this long before it sleeps: a server on this host answers
// within microseconds, and a wake-up costs about as much. Pipelines of many
// chunks do not poll: there the CPU is better spent copying and summing.
constexpr int64_t kReceiverSpinNs = 50'000;

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

double NowMicros() {
  return std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string FormatSeconds(double s) {
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
  std::string error;
  // A call with a tree check: a tensor's error that says the workers' trees
  // differ waits for the check's own error, which names both workers'
  // leaves; the call's deadline bounds the wait (TimeoutMessage then gives it).
  bool tree_pending = false;
  std::string deferred;
  RoundKey tree_round{0, 0};  // the tree check's key and round, while pending
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
  int op = 0;              // the (first) operand it carries: its dtype, its name in errors
  std::vector<Part> parts; // one, or several small ones fused into one message
  size_t nbytes = 0;       // of all parts
  int slot = -1;           // the shared-memory push slot it occupies until acknowledged
  uint64_t key = 0;
  uint32_t round = 0;
  int server = 0;
  int64_t priority = 0;
  uint64_t seq = 0;
  bool skipped = false;  // never sent (its call failed first)
  bool tree = false;     // the call's tree check (kTree), not data
  std::string payload;   // a tree check's: its digest, then its description when the server has not seen it
  ChunkTimes times;  // set only when tracing
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
  // Shared memory with a server on this host (shm.h), else null: pushes are
  // written into `push_region` slots, sums read from the server's arena.
  std::shared_ptr<SharedRegion> push_region;
  std::shared_ptr<SharedRegion> sum_region;
  size_t slot_bytes = 0;
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
  // Guarded by Engine::Impl::mu.
  std::deque<ChunkPtr> sendq;
  std::deque<ChunkPtr> unacked;  // dispatched, in send order, awaiting kPushAck
  std::condition_variable send_cv;
  bool sending = false;  // a thread is writing chunks taken from sendq (one at a time keeps their order)
  bool bye = false;
  bool failed = false;
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

}  // namespace

uint64_t TreeDigest(std::string_view tree) {
  uint64_t h = SplitMix64(tree.size());
  size_t i = 0;
  for (; i + 8 <= tree.size(); i += 8) {
    uint64_t word;
    std::memcpy(&word, tree.data() + i, 8);
    h = SplitMix64(h ^ word);
  }
  uint64_t tail = 0;
  std::memcpy(&tail, tree.data() + i, tree.size() - i);
  return SplitMix64(h ^ tail);
}

uint64_t ChunkKey(uint64_t base_key, uint32_t shard, uint32_t chunk) {
  uint64_t k = SplitMix64(base_key ^ SplitMix64((static_cast<uint64_t>(shard) << 32) | chunk));
  return k == 0 ? 1 : k;  // key 0 marks connection-level errors on the wire
}

struct Engine::Impl {
  EngineOptions opt;
  int stall_ms = 60000;

  std::vector<ServerRole> roles;  // per connection, from the hello replies

  std::mutex mu;
  std::condition_variable watchdog_cv;
  bool running = false;
  bool stopping = false;
  std::string bye_reason;  // sent with the goodbyes (Stop)
  std::string fault;  // first job-wide failure; see Engine::fault()
  std::atomic<bool> all_local{false};  // every server shares memory with this worker (while running)
  std::atomic<bool> huge_pages{false};  // opt.huge_pages, read by the handlers without mu
  std::priority_queue<ChunkPtr, std::vector<ChunkPtr>, ChunkOrder> queue;
  int inflight_chunks = 0;  // dispatched, not yet acknowledged: bounded by opt.credit
  std::unordered_map<RoundKey, ChunkPtr, RoundKeyHash> pending;  // sent or sending, sum not yet received
  std::unordered_map<uint64_t, uint32_t> next_round;
  std::map<uint64_t, CallPtr> active;  // by id: ids grow with deadlines
  // Wall time with at least one call in flight (the union, not the sum, of
  // overlapping calls): the communication share of a step, for users.
  Clock::time_point busy_since;
  std::atomic<uint64_t> busy_ns{0};
  void AddActive(const CallPtr& c);   // with mu held
  void EraseActive(uint64_t id);      // with mu held
  std::vector<std::unique_ptr<ServerConn>> conns;
  uint64_t next_call_id = 1;
  uint64_t next_seq = 0;
  std::thread watchdog;

  std::mutex trace_mu;
  std::vector<TraceRecord> trace;

  std::atomic<bool> stage_timing{false};
  std::mutex stages_mu;
  std::vector<StageRecord> stages;

  std::mutex completer_mu;
  std::unordered_map<uint32_t, std::unique_ptr<Completer>> completers;

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
  void SetFault(const std::string& msg);
  void DropSkipped(ServerConn* sc);
  // With mu held: a push of sc acknowledged (its credit back); false when it was not waiting for one.
  bool AckLocked(ServerConn* sc, const RoundKey& rk);
  bool Drain(int fd, uint64_t nbytes, std::vector<char>* scratch);
  void AttachShm(ServerConn* sc);
  std::vector<ChunkPtr> FuseSmallChunks(std::vector<ChunkPtr> chunks, size_t partition, uint32_t shard);
  IoStatus SendRelease(ServerConn* sc, const FrameHeader& sum);
  std::string TimeoutMessage(const CallPtr& c);
};

Engine::Engine() : impl_(std::make_shared<Impl>()) {}

Engine& Engine::Get() {
  static Engine* engine = new Engine();  // never destroyed: threads are stopped by Stop()
  return *engine;
}

bool Engine::SetCredit(int credit, std::string* err) {
  if (credit < 1) {
    *err = "credit must be >= 1";
    return false;
  }
  std::vector<Impl::Lost> lost;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->opt.credit = credit;
    lost = impl_->DispatchLocked();
  }
  impl_->FailLost(lost);
  return true;
}

bool Engine::all_servers_local() const { return impl_->all_local.load(std::memory_order_relaxed); }

bool Engine::huge_pages() const { return impl_->huge_pages.load(std::memory_order_relaxed); }

bool Engine::running() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->running;
}

std::string Engine::fault() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->fault;
}

EngineStats Engine::stats() const {
  EngineStats s;
  s.calls = impl_->calls.load();
  s.calls_failed = impl_->calls_failed.load();
  s.chunks_pushed = impl_->chunks_pushed.load();
  s.bytes_pushed = impl_->bytes_pushed.load();
  s.bytes_pulled = impl_->bytes_pulled.load();
  s.busy_seconds = impl_->busy_ns.load() * 1e-9;
  s.bytes_shm = impl_->bytes_shm.load();
  s.chunks_fused = impl_->chunks_fused.load();
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (auto& c : impl_->conns) {
    s.shm_servers += c->push_region != nullptr;
    s.server_bytes_pushed.push_back(c->bytes_pushed.load());
  }
  return s;
}

std::vector<ServerRole> Engine::server_roles() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->roles;
}

std::vector<TraceRecord> Engine::TakeTrace() {
  std::lock_guard<std::mutex> lock(impl_->trace_mu);
  std::vector<TraceRecord> out;
  out.swap(impl_->trace);
  return out;
}

size_t Engine::ChunkBytes(DType dtype, size_t partition_bytes) {
  size_t elem = DTypeSize(dtype);
  return std::max(elem, partition_bytes - partition_bytes % elem);
}

size_t Engine::NumChunks(size_t nbytes, DType dtype, size_t partition_bytes) {
  size_t part = ChunkBytes(dtype, partition_bytes);
  return (nbytes + part - 1) / part;
}

bool Engine::Start(const EngineOptions& options, std::string* err) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.running) {
    *err = "the jbps engine is already running";
    return false;
  }
  if (options.servers.empty()) {
    *err = "no summation servers given";
    return false;
  }
  if (options.num_workers < 1 || options.rank >= options.num_workers) {
    *err = "worker rank " + std::to_string(options.rank) + " out of range for " +
           std::to_string(options.num_workers) + " workers";
    return false;
  }
  if (options.credit < 1 || options.timeout_s <= 0) {
    *err = "credit must be >= 1 and timeout_s > 0";
    return false;
  }
  s.opt = options;
  s.stall_ms = static_cast<int>(std::min(options.timeout_s * 1000, 2e9));
  std::vector<ServerRole> roles;

  auto deadline = Clock::now() + std::chrono::duration<double>(options.timeout_s);
  std::vector<std::unique_ptr<ServerConn>> conns;
  auto fail = [&](const std::string& why) {
    // Servers already greeted hear a goodbye, so they do not count this worker as lost.
    FrameHeader bye = MakeHeader(MsgType::kBye, options.token);
    bye.sender = options.rank;
    for (auto& c : conns) {
      struct iovec iov = {&bye, sizeof(bye)};
      SendAll(c->fd, &iov, 1, 1000);
      CloseFd(c->fd);
    }
    *err = why;
    return false;
  };
  for (size_t i = 0; i < options.servers.size(); ++i) {
    auto sc = std::make_unique<ServerConn>();
    sc->index = static_cast<int>(i);
    if (!ParseHostPort(options.servers[i], &sc->addr, err)) return fail("server " + *err);
    double left = std::chrono::duration<double>(deadline - Clock::now()).count();
    sc->fd = ConnectWithRetry(sc->addr, std::max(left, 0.001), err);
    if (sc->fd < 0) return fail(*err);
    SetLiveness(sc->fd, options.timeout_s);
    conns.push_back(std::move(sc));
    ServerConn& c = *conns.back();
    FrameHeader hello = MakeHeader(MsgType::kHello, options.token);
    hello.sender = options.rank;
    hello.key = options.num_workers;
    struct iovec iov = {&hello, sizeof(hello)};
    FrameHeader reply;
    IoStatus st = SendAll(c.fd, &iov, 1, s.stall_ms);
    if (st == IoStatus::kOk) st = RecvAll(c.fd, &reply, sizeof(reply), s.stall_ms, s.stall_ms);
    if (st != IoStatus::kOk)
      return fail("server " + c.addr.ToString() + " did not answer the hello: " + IoStatusName(st) +
                  " (wrong job token, or not a jbps server?)");
    std::string why = ValidateHeader(reply, options.token);
    if (!why.empty()) return fail("server " + c.addr.ToString() + ": " + why);
    if (reply.type == static_cast<uint16_t>(MsgType::kError)) {
      std::string text(reply.nbytes, '\0');
      RecvAll(c.fd, text.data(), text.size(), s.stall_ms, s.stall_ms);
      return fail("server " + c.addr.ToString() + " refused this worker: " + text);
    }
    if (reply.type != static_cast<uint16_t>(MsgType::kHelloOk))
      return fail("server " + c.addr.ToString() + " answered the hello with message type " +
                  std::to_string(reply.type));
    if (reply.key > static_cast<uint64_t>(ServerRole::kDedicated))
      return fail("server " + c.addr.ToString() + " declared unknown role " + std::to_string(reply.key));
    roles.push_back(static_cast<ServerRole>(reply.key));
    c.instance = (static_cast<uint64_t>(reply.round) << 32) | reply.sender;
  }
  if (options.shm) {
    for (auto& c : conns) s.AttachShm(c.get());
  }
  s.all_local = std::all_of(conns.begin(), conns.end(), [](const auto& c) { return c->push_region != nullptr; });
  s.huge_pages = options.huge_pages;
  s.conns = std::move(conns);
  s.roles = std::move(roles);
  s.running = true;
  s.stopping = false;
  s.fault.clear();
  for (auto& c : s.conns) {
    ServerConn* sc = c.get();
    sc->sender = std::thread([&s, sc] { s.SendLoop(sc); });
    sc->receiver = std::thread([&s, sc] { s.RecvLoop(sc); });
  }
  s.watchdog = std::thread([&s] { s.WatchdogLoop(); });
  return true;
}

void Engine::Stop(const std::string& reason) {
  Impl& s = *impl_;
  std::vector<CallPtr> victims;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.running || s.stopping) return;
    s.stopping = true;
    s.bye_reason = reason.substr(0, kMaxErrorBytes);
    for (auto& kv : s.active) victims.push_back(kv.second);
  }
  s.watchdog_cv.notify_all();
  s.watchdog.join();
  for (auto& c : victims) s.FailCall(c, "jbps: shut down while this psum was pending");
  {
    std::lock_guard<std::mutex> lock(s.mu);
    for (auto& c : s.conns) {
      c->bye = true;
      c->send_cv.notify_all();
    }
  }
  for (auto& c : s.conns) c->sender.join();  // each says goodbye, then exits
  for (auto& c : s.conns) {
    ShutdownFd(c->fd);
    c->receiver.join();
    CloseFd(c->fd);
  }
  {
    std::lock_guard<std::mutex> lock(s.completer_mu);
    s.completers.clear();  // runs what is queued, then joins
  }
  std::lock_guard<std::mutex> lock(s.mu);
  s.conns.clear();
  s.queue = {};
  s.pending.clear();
  s.next_round.clear();
  s.active.clear();
  s.roles.clear();
  s.inflight_chunks = 0;
  s.fault.clear();
  s.running = false;
  s.all_local = false;
  s.stopping = false;
}

void Engine::SetStageTiming(bool on) { impl_->stage_timing = on; }

std::vector<StageRecord> Engine::TakeStages() {
  std::lock_guard<std::mutex> lock(impl_->stages_mu);
  std::vector<StageRecord> out;
  out.swap(impl_->stages);
  return out;
}

void Engine::Submit(CallSpec spec, DoneFn done, EarlyDoneFn early) {
  Impl& s = *impl_;
  const int64_t submitted = s.stage_timing.load(std::memory_order_relaxed) ? SteadyNs() : 0;
  auto call = std::make_shared<Call>();
  call->engine = &s;
  call->spec = std::move(spec);
  call->done = std::move(done);
  call->early = std::move(early);
  if (submitted != 0) {
    call->timed = true;
    call->stage.submitted = submitted;
    call->stage.name = call->TensorName(0);
    for (const Operand& op : call->spec.operands) call->stage.bytes += op.nbytes;
  }
  std::vector<ChunkPtr> chunks;
  const size_t partition = std::max<size_t>(call->spec.partition_bytes, 1);
  size_t next_server = 0;
  for (size_t i = 0; i < call->spec.operands.size(); ++i) {
    const Operand& op = call->spec.operands[i];
    if (op.nbytes == 0) continue;
    size_t part = ChunkBytes(op.dtype, partition);
    uint32_t n = static_cast<uint32_t>((op.nbytes + part - 1) / part);
    for (uint32_t c = 0; c < n; ++c) {
      auto ch = std::make_shared<Chunk>();
      ch->call = call;
      ch->op = static_cast<int>(i);
      ch->nbytes = std::min(part, op.nbytes - c * part);
      ch->parts.push_back(Part{ch->op, c * part, ch->nbytes});
      ch->key = ChunkKey(op.base_key, call->spec.shard, c);
      ch->priority = op.priority;
      ch->server = next_server < call->spec.servers.size() ? call->spec.servers[next_server] : -1;
      ++next_server;
      chunks.push_back(std::move(ch));
    }
  }
  chunks = s.FuseSmallChunks(std::move(chunks), partition, call->spec.shard);
  if (call->spec.tree_digest == 0 && !call->spec.tree.empty()) call->spec.tree_digest = TreeDigest(call->spec.tree);
  call->total_chunks = call->remaining = chunks.size();
  // The tree check: no credit, no answer unless the trees differ (so the
  // call waits on its data alone), first on its connection.
  ChunkPtr tree;
  if (!chunks.empty() && !call->spec.tree.empty()) {
    tree = std::make_shared<Chunk>();
    tree->call = call;
    tree->tree = true;
    tree->key = ChunkKey(call->spec.tree_key, call->spec.shard, 0);
    call->tree_pending = true;
  }

  std::string fail;
  std::vector<Impl::Lost> lost;
  std::vector<std::pair<ServerConn*, std::vector<ChunkPtr>>> direct;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.running || s.stopping) {
      fail = "the jbps engine is not running: call jbps.init() first (or it was shut down)";
    } else if (next_server != call->spec.servers.size()) {
      fail = "jbps: the psum's plan routes " + std::to_string(call->spec.servers.size()) + " chunks, the engine cut " +
             std::to_string(next_server) + " (internal error: plan and engine disagree on chunking)";
    } else if (!s.fault.empty()) {
      fail = s.fault;
    } else {
      for (auto& ch : chunks) {
        if (ch->server < 0 || static_cast<size_t>(ch->server) >= s.conns.size()) {
          fail = "jbps: the psum was planned for more servers (chunk routed to server " + std::to_string(ch->server) +
                 ") than the engine has (" + std::to_string(s.conns.size()) +
                 "); re-trace it after jbps.init() with the new servers";
          break;
        }
      }
    }
    if (fail.empty()) {
      call->id = s.next_call_id++;
      call->deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(s.opt.timeout_s));
      // Queued means in the priority queue, under mu: a trace can then tell
      // which chunks this call found waiting there.
      const double now = s.opt.trace ? NowMicros() : 0;
      if (tree) {
        tree->times.queued = now;
        s.QueueTreeCheck(tree);
      }
      for (auto& ch : chunks) {
        ch->times.queued = now;
        ch->round = s.next_round[ch->key]++;
        ch->seq = s.next_seq++;
        s.queue.push(ch);
      }
      s.AddActive(call);
      ++s.calls;
      lost = s.DispatchLocked(/*wake_senders=*/false);
      direct = s.TakeDirectSends();
    }
  }
  for (auto& [sc, batch] : direct) s.WriteChunks(sc, batch);
  s.FailLost(lost);
  if (!fail.empty()) {
    ++s.calls;
    s.FailCall(call, fail);
    return;
  }
  if (chunks.empty()) {
    call->remaining = 1;  // nothing to send: complete through the usual path
    s.ChunkDone(call.get());
    return;
  }
  s.watchdog_cv.notify_one();
}

// Moves chunks from the priority queue to their servers' send queues while
// credits last. The credit window bounds chunks on the wire, so a
// high-priority chunk that arrives now waits behind at most `credit` chunks,
// not a whole model. Run, with mu held, by whichever thread queued chunks or
// freed a credit (Submit, an acknowledgement, a skipped chunk): no thread hop
// stands between a credit and the next push. Returns the calls whose server
// was lost, to fail once mu is released (FailLost).
std::vector<Engine::Impl::Lost> Engine::Impl::DispatchLocked(bool wake_senders) {
  std::vector<Lost> lost;
  while (!stopping && !queue.empty() && inflight_chunks < opt.credit) {
    ChunkPtr ch = queue.top();
    queue.pop();
    if (ch->call->failed) continue;
    ServerConn* sc = conns[ch->server].get();
    if (sc->failed) {
      lost.push_back(Lost{ch->call, ch->server});
      continue;
    }
    ++inflight_chunks;
    pending[RoundKey{ch->key, ch->round}] = ch;
    sc->unacked.push_back(ch);
    sc->sendq.push_back(ch);
  }
  if (wake_senders) WakeSendersLocked();
  return lost;
}

// With mu held: each connection with chunks to send and nobody sending them
// wakes its sender thread.
void Engine::Impl::WakeSendersLocked() {
  for (auto& c : conns)
    if (!c->failed && !c->sending && !c->sendq.empty()) c->send_cv.notify_one();
}

// With mu held: queues a call's tree check on the connection of its
// tree_key's server (the same on every worker), with the description unless
// that connection sent it before.
void Engine::Impl::QueueTreeCheck(const ChunkPtr& tree) {
  Call* call = tree->call.get();
  tree->server = static_cast<int>(call->spec.tree_key % conns.size());
  ServerConn* sc = conns[tree->server].get();
  tree->round = next_round[tree->key]++;
  tree->seq = next_seq++;
  const uint64_t digest = call->spec.tree_digest;
  tree->payload.assign(reinterpret_cast<const char*>(&digest), sizeof(digest));
  if (sc->described_trees.count(digest) == 0) {
    const std::string& text = call->spec.tree;
    tree->payload += text;
    // The server keeps what fits its bounds, in the order it reads them.
    if (sc->described_trees.size() < kMaxDescribedTrees &&
        sc->described_tree_bytes + text.size() <= kMaxDescribedTreeBytes) {
      sc->described_trees.insert(digest);
      sc->described_tree_bytes += text.size();
    }
  }
  tree->nbytes = tree->payload.size();
  pending[RoundKey{tree->key, tree->round}] = tree;
  call->tree_round = RoundKey{tree->key, tree->round};
  sc->sendq.push_back(tree);
}

// With mu held: takes chunks from the front of sc's send queue for one write
// and marks the connection as being sent on. The sender thread (no
// direct_budget) takes what is there, waiting (with `lock`) a little for a
// shared-memory slot when the first push needs one; a direct send (the
// thread that queued them) takes pushes that need no waiting, up to
// direct_budget bytes of them (see kDirectCopyBytes).
std::vector<ChunkPtr> Engine::Impl::TakeSendable(ServerConn* sc, size_t direct_budget,
                                                 std::unique_lock<std::mutex>* lock) {
  const bool direct = direct_budget > 0;
  std::vector<ChunkPtr> batch;
  size_t taken = 0;
  size_t iovecs = 0;
  while (!sc->sendq.empty() && batch.size() < kMaxSendBatch) {
    ChunkPtr ch = sc->sendq.front();
    const size_t need = ch->tree ? 2 : 1 + std::max<size_t>(1, ch->parts.size());  // at most, as if over TCP
    if (!batch.empty() && iovecs + need > kMaxSendIovecs) break;
    iovecs += need;
    if (!ch->tree) {
      const bool in_slot = sc->push_region && ch->nbytes <= sc->slot_bytes;
      if (direct && taken + ch->nbytes > (in_slot ? direct_budget : std::min(direct_budget, kDirectSmallBytes))) break;
      if (in_slot) {
        if (sc->free_slots.empty() && !direct && batch.empty() && lock != nullptr && !sc->slots_starved) {
          // All slots parked on the server means this worker is ahead of the
          // others; their pushes free slots soon, so wait a little for one.
          // Bounded, since a peer may be on other keys: then TCP.
          sc->sending = true;  // nobody else takes from sendq meanwhile
          sc->slot_cv.wait_for(*lock, std::chrono::milliseconds(kSlotWaitMs),
                               [&] { return !sc->free_slots.empty() || sc->failed; });
          if (sc->failed || sc->sendq.empty()) break;
          sc->slots_starved = sc->free_slots.empty();
          ch = sc->sendq.front();
        }
        if (!sc->free_slots.empty()) {
          ch->slot = sc->free_slots.back();
          sc->free_slots.pop_back();
          sc->slot_of[RoundKey{ch->key, ch->round}] = ch->slot;
        } else if (direct || !batch.empty()) {
          break;  // the sender waits for a slot first
        }  // else no slot came: this push goes over TCP
      }
      taken += ch->nbytes;
    }
    sc->sendq.pop_front();
    if (opt.trace) ch->times.sent_start = NowMicros();
    batch.push_back(std::move(ch));
  }
  sc->sending = !batch.empty();
  return batch;
}

// With mu held: the direct sends (see kDirectCopyBytes) of the idle
// connections, smallest first; a connection left with chunks only its sender
// may take wakes it now, so that its copies run beside this thread's.
std::vector<std::pair<ServerConn*, std::vector<ChunkPtr>>> Engine::Impl::TakeDirectSends() {
  std::vector<std::pair<ServerConn*, std::vector<ChunkPtr>>> out;
  bool copying = false;  // one connection gets the larger budget
  for (auto& c : conns) {
    if (c->failed || c->sending || c->sendq.empty()) continue;
    std::vector<ChunkPtr> batch = TakeSendable(c.get(), copying ? kDirectSmallBytes : kDirectCopyBytes, nullptr);
    size_t bytes = 0;
    for (auto& ch : batch) bytes += ch->tree ? 0 : ch->nbytes;
    copying = copying || bytes > kDirectSmallBytes;
    if (!c->sendq.empty() && batch.empty()) c->send_cv.notify_one();
    if (batch.empty()) continue;
    if (bytes > kDirectSmallBytes) {
      out.emplace_back(c.get(), std::move(batch));  // last: the small ones go out first
    } else {
      out.emplace(out.begin(), c.get(), std::move(batch));
    }
  }
  return out;
}

void Engine::Impl::FailLost(const std::vector<Lost>& lost) {
  for (const Lost& l : lost)
    FailCall(l.call, "jbps: lost summation server " + conns[l.server]->addr.ToString() + " earlier in this job");
}

bool Engine::Impl::AckLocked(ServerConn* sc, const RoundKey& rk) {
  auto it = std::find_if(sc->unacked.begin(), sc->unacked.end(),
                         [&](const ChunkPtr& c) { return c->key == rk.key && c->round == rk.round; });
  if (it == sc->unacked.end()) return false;
  if (opt.trace) (*it)->times.acked = NowMicros();
  --inflight_chunks;
  sc->unacked.erase(it);
  DropSkipped(sc);
  return true;
}

void Engine::Impl::DropSkipped(ServerConn* sc) {
  // Never-sent chunks give their credit back (the deque is at most `credit` long).
  for (auto it = sc->unacked.begin(); it != sc->unacked.end();) {
    if ((*it)->skipped) {
      --inflight_chunks;
      it = sc->unacked.erase(it);
    } else {
      ++it;
    }
  }
}

void Engine::Impl::SendLoop(ServerConn* sc) {
  NameThisThread("jbps-push");
  for (;;) {
    std::vector<ChunkPtr> batch;
    {
      std::unique_lock<std::mutex> lock(mu);
      sc->send_cv.wait(lock, [&] { return sc->failed || (!sc->sending && (sc->bye || !sc->sendq.empty())); });
      if (sc->failed) return;
      if (sc->sendq.empty()) break;  // asked to stop and nothing left to send
      batch = TakeSendable(sc, /*direct_budget=*/0, &lock);
      if (sc->failed) return;
    }
    if (!batch.empty() && !WriteChunks(sc, batch)) return;
  }
  FrameHeader bye = MakeHeader(MsgType::kBye, opt.token);
  bye.sender = opt.rank;
  bye.nbytes = bye_reason.size();
  struct iovec iov[2] = {{&bye, sizeof(bye)}, {const_cast<char*>(bye_reason.data()), bye_reason.size()}};
  std::lock_guard<std::mutex> lock(sc->write_mu);
  SendAll(sc->fd, iov, bye_reason.empty() ? 1 : 2, 1000);
}

// Writes chunks taken by TakeSendable in one sendmsg (shared-memory pushes
// copied into their slots first), then hands the connection back. A chunk
// whose call failed meanwhile is not sent, and gives its credit back. False
// when the connection failed.
bool Engine::Impl::WriteChunks(ServerConn* sc, std::vector<ChunkPtr>& batch) {
  struct Outgoing {
    Chunk* ch;
    FrameHeader h;
    ShmRef ref;
  };
  std::vector<Outgoing> out;
  out.reserve(batch.size());  // the iovecs point into it
  std::vector<ChunkPtr> skipped;
  for (ChunkPtr& ch : batch) {
    Call* call = ch->call.get();
    if (!ch->tree && !call->TryAcquire()) {
      skipped.push_back(ch);
      continue;
    }
    out.push_back(Outgoing{ch.get(), MakeHeader(ch->tree ? MsgType::kTree : MsgType::kPush, opt.token), ShmRef{}});
    Outgoing& o = out.back();
    o.h.key = ch->key;
    o.h.round = ch->round;
    o.h.sender = opt.rank;
    o.h.nbytes = ch->nbytes;
    if (call->timed) o.h.flags |= kFlagTimed;
    if (ch->tree) continue;
    o.h.dtype = static_cast<uint8_t>(call->spec.operands[ch->op].dtype);
    o.h.aux = static_cast<uint32_t>(call->spec.tree_digest);
    if (ch->slot >= 0) {
      // The transport's one copy in: XLA's buffer is not in shared memory.
      o.ref.offset = static_cast<uint64_t>(ch->slot) * sc->slot_bytes;
      o.ref.nbytes = ch->nbytes;
      char* dst = sc->push_region->data() + o.ref.offset;
      for (const Part& p : ch->parts) {
        std::memcpy(dst, static_cast<const char*>(call->spec.operands[p.op].in) + p.offset, p.nbytes);
        dst += p.nbytes;
      }
      o.h.type = static_cast<uint16_t>(MsgType::kPushShm);
      o.h.nbytes = sizeof(o.ref);
    }
  }
  std::vector<struct iovec> iov;
  for (Outgoing& o : out) {
    iov.push_back({&o.h, sizeof(o.h)});
    if (o.ch->tree) {
      iov.push_back({const_cast<char*>(o.ch->payload.data()), o.ch->payload.size()});
    } else if (o.ch->slot >= 0) {
      iov.push_back({&o.ref, sizeof(o.ref)});
    } else {
      for (const Part& p : o.ch->parts)  // straight from XLA's buffers, gathered by sendmsg
        iov.push_back({const_cast<char*>(static_cast<const char*>(o.ch->call->spec.operands[p.op].in) + p.offset),
                       p.nbytes});
    }
  }
  // Stamped before the write: the server may read the push (and a woken
  // reader preempt this thread) before sendmsg returns.
  const int64_t written = stage_timing.load(std::memory_order_relaxed) ? SteadyNs() : 0;
  int data_chunks = 0;
  for (Outgoing& o : out) data_chunks += !o.ch->tree;
  sc->awaiting += data_chunks;
  IoStatus st = IoStatus::kOk;
  if (!iov.empty()) {
    std::lock_guard<std::mutex> lock(sc->write_mu);
    st = SendAll(sc->fd, iov.data(), static_cast<int>(iov.size()), stall_ms);
  }
  for (Outgoing& o : out) {
    if (o.ch->tree) continue;
    Call* call = o.ch->call.get();
    if (call->timed && written != 0 && st == IoStatus::kOk) {
      std::lock_guard<std::mutex> lock(call->mu);
      call->stage.pushed = std::max(call->stage.pushed, written);
    }
    ReleaseIo(call);
    if (st != IoStatus::kOk) continue;
    ++chunks_pushed;
    bytes_pushed += o.ch->nbytes;
    sc->bytes_pushed += o.ch->nbytes;
    if (o.ch->slot >= 0) bytes_shm += o.ch->nbytes;
  }
  std::vector<Lost> lost;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (ChunkPtr& ch : skipped) {
      auto it = pending.find(RoundKey{ch->key, ch->round});
      if (it != pending.end() && it->second == ch) pending.erase(it);
      ch->skipped = true;
      if (ch->slot >= 0) {  // never sent: the slot was never the server's
        sc->slot_of.erase(RoundKey{ch->key, ch->round});
        sc->free_slots.push_back(ch->slot);
        sc->slots_starved = false;
        sc->slot_cv.notify_one();
      }
    }
    if (!skipped.empty()) {
      DropSkipped(sc);
      lost = DispatchLocked();
    }
    sc->sending = false;
    // The sender waits for the connection while this thread writes: for what
    // is left to send, or to say goodbye (Stop).
    if (!sc->sendq.empty() || sc->bye) sc->send_cv.notify_one();
  }
  FailLost(lost);
  if (st != IoStatus::kOk) {
    ConnFailed(sc, std::string("send failed: ") + IoStatusName(st));
    return false;
  }
  return true;
}

bool Engine::Impl::Drain(int fd, uint64_t nbytes, std::vector<char>* scratch) {
  scratch->resize(1 << 20);
  while (nbytes > 0) {
    size_t n = std::min<uint64_t>(nbytes, scratch->size());
    if (RecvAll(fd, scratch->data(), n, stall_ms, stall_ms) != IoStatus::kOk) return false;
    nbytes -= n;
  }
  return true;
}

void Engine::Impl::RecvLoop(ServerConn* sc) {
  NameThisThread("jbps-pull");
  std::vector<char> scratch;
  const std::string server = sc->addr.ToString();
  for (;;) {
    FrameHeader h;
    if (sc->push_region && sc->awaiting.load(std::memory_order_relaxed) == 1)
      SpinUntilReadable(sc->fd, SteadyNs() + kReceiverSpinNs);
    IoStatus st = RecvAll(sc->fd, &h, sizeof(h), -1, stall_ms);
    if (st != IoStatus::kOk) {
      ConnFailed(sc, IoStatusName(st));
      return;
    }
    const int64_t header_read = stage_timing.load(std::memory_order_relaxed) ? SteadyNs() : 0;
    std::string why = ValidateHeader(h, opt.token);
    if (!why.empty()) {
      ConnFailed(sc, "protocol error: " + why);
      return;
    }
    const auto type = static_cast<MsgType>(h.type);
    if (type == MsgType::kPushAck) {
      // TCP pushes are acknowledged in order as they arrive; shared-memory
      // ones once added, by whichever server thread owns the key.
      std::vector<Lost> lost;
      {
        std::lock_guard<std::mutex> lock(mu);
        AckLocked(sc, RoundKey{h.key, h.round});
        lost = DispatchLocked();
      }
      FailLost(lost);
      continue;
    }
    if (type == MsgType::kAbort) {
      std::string text(h.nbytes, '\0');
      if (RecvAll(sc->fd, text.data(), text.size(), stall_ms, stall_ms) != IoStatus::kOk) {
        ConnFailed(sc, "truncated abort message");
        return;
      }
      SetFault(text);
      continue;
    }
    ShmRef ref;
    if (type == MsgType::kSumShm) {
      if (RecvAll(sc->fd, &ref, sizeof(ref), stall_ms, stall_ms) != IoStatus::kOk) {
        ConnFailed(sc, "truncated shared-memory sum");
        return;
      }
      if (!sc->sum_region || !sc->sum_region->Contains(ref.offset, ref.nbytes)) {
        ConnFailed(sc, "protocol error: a shared-memory sum outside the server's arena");
        return;
      }
    } else if (type != MsgType::kSum && type != MsgType::kError) {
      ConnFailed(sc, "protocol error: unexpected message type " + std::to_string(h.type));
      return;
    }
    ChunkPtr ch;
    std::vector<Lost> lost;
    {
      std::lock_guard<std::mutex> lock(mu);
      const RoundKey rk{h.key, h.round};
      auto it = pending.find(rk);
      if (it != pending.end()) {
        ch = it->second;
        pending.erase(it);
      }
      if (type != MsgType::kError || (ch && !ch->tree)) sc->awaiting.fetch_sub(1, std::memory_order_relaxed);
      auto slot = sc->slot_of.find(rk);
      if (slot != sc->slot_of.end()) {  // the round is over on the server: the slot is ours again
        sc->free_slots.push_back(slot->second);
        sc->slot_of.erase(slot);
        sc->slots_starved = false;
        sc->slot_cv.notify_one();
      }
      // A round's sum or error acknowledges this worker's push too: a server
      // answering the last push of a round sends no separate kPushAck.
      if (AckLocked(sc, rk)) lost = DispatchLocked();
    }
    FailLost(lost);
    if (type == MsgType::kError) {
      std::string text(h.nbytes, '\0');
      if (RecvAll(sc->fd, text.data(), text.size(), stall_ms, stall_ms) != IoStatus::kOk) {
        ConnFailed(sc, "truncated error message");
        return;
      }
      if (ch && ch->tree) {
        {
          std::lock_guard<std::mutex> lock(ch->call->mu);
          ch->call->tree_pending = false;
          if (ch->call->timed) ch->call->stage.tree_checked = header_read;
        }
        FailCall(ch->call, "jbps: " + text + " (server " + server + ")");
      } else if (ch) {
        std::string msg = "jbps: psum of tensor '" + ch->call->TensorName(ch->op) + "' failed on server " + server +
                          ": " + text;
        bool defer = false;
        if (h.flags & kFlagTreeMismatch) {  // the tree check's error names the leaf: wait for it
          std::lock_guard<std::mutex> lock(ch->call->mu);
          defer = ch->call->tree_pending;
          if (defer && ch->call->deferred.empty()) ch->call->deferred = msg;
        }
        if (!defer) FailCall(ch->call, msg);
      } else if (h.key == 0) {
        ConnFailed(sc, text);
        return;
      }
      continue;
    }
    if (ch && ch->tree) {  // a tree check is answered only when the trees differ
      ConnFailed(sc, "protocol error: a tree check answered with a sum");
      return;
    }
    // kSum / kSumShm: land the sum in the output buffers, or drop it if its call is gone.
    const bool shm = type == MsgType::kSumShm;
    const uint64_t sum_bytes = shm ? ref.nbytes : h.nbytes;
    bool wanted = ch && ch->call->TryAcquire();
    if (wanted) {
      const Operand& op = ch->call->spec.operands[ch->op];
      if (sum_bytes != ch->nbytes || h.dtype != static_cast<uint8_t>(op.dtype)) {
        FailCall(ch->call, "jbps: server " + server + " returned " + std::to_string(sum_bytes) +
                               " bytes for tensor '" + ch->call->TensorName(ch->op) + "', expected " +
                               std::to_string(ch->nbytes));
        ReleaseIo(ch->call.get());
        wanted = false;
      }
    }
    if (opt.trace && wanted) ch->times.sum_arrived = NowMicros();
    st = IoStatus::kOk;
    if (shm) {
      if (wanted) {  // the transport's one copy out, scattered to the parts
        const char* src = sc->sum_region->data() + ref.offset;
        for (const Part& p : ch->parts) {
          StreamCopy(static_cast<char*>(ch->call->spec.operands[p.op].out) + p.offset, src, p.nbytes);
          src += p.nbytes;
        }
        bytes_shm += sum_bytes;
        bytes_pulled += ch->nbytes;
        if (opt.trace) Record(*ch, NowMicros());
        if (ch->call->timed) StampSum(ch->call.get(), h, header_read);
        ChunkDone(ch->call.get());
        ReleaseIo(ch->call.get());  // the call may complete now: the release below is not on its path
      }
      st = SendRelease(sc, h);  // wanted or not, the server may reuse the block
      if (st != IoStatus::kOk) {
        ConnFailed(sc, std::string("releasing a sum: ") + IoStatusName(st));
        return;
      }
      continue;
    } else if (!wanted) {
      if (!Drain(sc->fd, h.nbytes, &scratch)) {
        ConnFailed(sc, "truncated sum");
        return;
      }
      continue;
    } else {
      for (const Part& p : ch->parts) {
        char* out = static_cast<char*>(ch->call->spec.operands[p.op].out) + p.offset;
        st = RecvAll(sc->fd, out, p.nbytes, stall_ms, stall_ms);
        if (st != IoStatus::kOk) break;
      }
    }
    if (!wanted) continue;
    if (st == IoStatus::kOk) {
      bytes_pulled += ch->nbytes;
      if (opt.trace) Record(*ch, NowMicros());
      if (ch->call->timed) StampSum(ch->call.get(), h, header_read);
      ChunkDone(ch->call.get());
    }
    ReleaseIo(ch->call.get());
    if (st != IoStatus::kOk) {
      ConnFailed(sc, std::string("receiving a sum: ") + IoStatusName(st));
      return;
    }
  }
}

IoStatus Engine::Impl::SendRelease(ServerConn* sc, const FrameHeader& sum) {
  FrameHeader r = MakeHeader(MsgType::kRelease, opt.token);
  r.key = sum.key;
  r.round = sum.round;
  r.sender = opt.rank;
  struct iovec iov = {&r, sizeof(r)};
  std::lock_guard<std::mutex> lock(sc->write_mu);
  return SendAll(sc->fd, &iov, 1, stall_ms);
}

// Offers the server a shared region of push slots over its Unix
// socket and maps the server's sum arena in return. A server on another
// host has no socket here, so the connect fails and the connection stays
// on TCP; so does any other failure, with a warning.
void Engine::Impl::AttachShm(ServerConn* sc) {
  if (sc->instance == 0) return;  // the server offers no shared memory
  std::string err;
  int sock = ConnectShmSocket(ShmSocketName(opt.token, sc->instance), &err);
  if (sock < 0) return;
  // More than the credit: slots stay taken until sums arrive, which can be
  // long after the credit's acks when this worker is ahead of the others.
  const size_t slots = kSlotsPerCredit * static_cast<size_t>(opt.credit);
  const size_t slot_bytes = std::max<size_t>(opt.shm_slot_bytes, 4096);
  auto region = SharedRegion::Create(slots * slot_bytes, "jbps-push", &err);
  std::shared_ptr<SharedRegion> arena;
  if (region) {
    FrameHeader offer = MakeHeader(MsgType::kShmOffer, opt.token);
    offer.sender = opt.rank;
    offer.key = slot_bytes;
    char reply_buf[sizeof(FrameHeader) + 1024];
    int fd = -1;
    ssize_t n = -1;
    if (SendWithFd(sock, &offer, sizeof(offer), region->fd(), stall_ms))
      n = RecvWithFd(sock, reply_buf, sizeof(reply_buf), &fd, stall_ms);
    FrameHeader reply;
    if (n >= static_cast<ssize_t>(sizeof(reply))) std::memcpy(&reply, reply_buf, sizeof(reply));
    if (n < static_cast<ssize_t>(sizeof(reply)) || !ValidateHeader(reply, opt.token).empty()) {
      err = "no valid answer to the offer";
    } else if (reply.type == static_cast<uint16_t>(MsgType::kError)) {
      err = std::string(reply_buf + sizeof(reply), n - sizeof(reply));
    } else if (reply.type != static_cast<uint16_t>(MsgType::kShmAccept) || fd < 0) {
      err = "unexpected answer to the offer";
    } else {
      arena = SharedRegion::Attach(fd, &err);
      fd = -1;
    }
    if (fd >= 0) CloseFd(fd);
  }
  CloseFd(sock);
  if (!arena) {
    LogWarning("jbps: shared memory with server %s failed (%s); using TCP", sc->addr.ToString().c_str(), err.c_str());
    return;
  }
  sc->push_region = std::move(region);
  sc->sum_region = std::move(arena);
  sc->slot_bytes = slot_bytes;
  for (size_t i = slots; i-- > 0;) sc->free_slots.push_back(static_cast<int>(i));
}

// Small chunks bound for one server travel as one message: per message a
// header, an ack, a sum and a wake-up on each side would otherwise dominate
// a tree of many small tensors. Chunks are taken in dispatch order (priority,
// then position); each server has one open group, which takes a small chunk
// of its dtype while the group stays within a partition. Every worker runs
// the same plan, so every worker fuses the same chunks under the same key.
std::vector<ChunkPtr> Engine::Impl::FuseSmallChunks(std::vector<ChunkPtr> chunks, size_t partition,
                                                    uint32_t shard) {
  const size_t small = partition / kSmallChunkDivisor;
  std::vector<size_t> order(chunks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return chunks[a]->priority > chunks[b]->priority; });
  auto dtype_of = [&](const ChunkPtr& c) { return c->call->spec.operands[c->op].dtype; };
  std::map<int, ChunkPtr> open;  // server -> its group (the first member, growing)
  std::vector<bool> absorbed(chunks.size(), false);
  uint64_t fused = 0;
  for (size_t i : order) {
    ChunkPtr& ch = chunks[i];
    if (ch->nbytes > small) continue;
    auto it = open.find(ch->server);
    if (it != open.end()) {
      ChunkPtr& g = it->second;
      if (dtype_of(g) == dtype_of(ch) && g->nbytes + ch->nbytes <= partition && g->parts.size() < kMaxFusedParts) {
        g->parts.insert(g->parts.end(), ch->parts.begin(), ch->parts.end());
        g->nbytes += ch->nbytes;
        // A fused chunk's own key names every member, in order (0 marks connection-level errors).
        g->key = SplitMix64(g->key ^ ChunkKey(ch->key, shard, 0xffffffffu));
        if (g->key == 0) g->key = 1;
        absorbed[i] = true;
        ++fused;
        continue;
      }
    }
    open[ch->server] = ch;  // a new group starts with this chunk
  }
  if (fused == 0) return chunks;
  chunks_fused += fused;
  std::vector<ChunkPtr> out;
  out.reserve(chunks.size() - fused);
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (!absorbed[i]) out.push_back(std::move(chunks[i]));
  }
  return out;
}

std::string Engine::Impl::TimeoutMessage(const CallPtr& c) {
  // Called with mu held.
  std::vector<std::string> waiting;
  int first_op = -1;
  size_t missing = 0;
  for (auto& kv : pending) {
    if (kv.second->call != c || kv.second->tree) continue;
    ++missing;
    if (first_op < 0) first_op = kv.second->op;
    std::string name = conns[kv.second->server]->addr.ToString();
    if (std::find(waiting.begin(), waiting.end(), name) == waiting.end()) waiting.push_back(name);
  }
  std::string msg = "jbps: psum timed out after " + FormatSeconds(opt.timeout_s) + " s (JBPS_TIMEOUT_S)";
  size_t remaining;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    remaining = c->remaining;
    if (!c->deferred.empty()) return c->deferred;  // a known cause beats "timed out"
  }
  msg += ": " + std::to_string(remaining) + " of " + std::to_string(c->total_chunks) + " chunks not summed";
  if (first_op >= 0) {
    msg += "; tensor '" + c->TensorName(first_op) + "' is waiting on server";
    for (auto& w : waiting) msg += " " + w;
    msg += " for the other workers' pushes (is a worker missing, or calling psum with a different tree?)";
  } else {
    msg += " (chunks still queued: the credit window is held by other calls)";
  }
  return msg;
}

void Engine::Impl::WatchdogLoop() {
  NameThisThread("jbps-watchdog");
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    if (stopping) return;
    if (active.empty()) {
      watchdog_cv.wait(lock);
      continue;
    }
    CallPtr first = active.begin()->second;
    if (Clock::now() < first->deadline) {
      watchdog_cv.wait_until(lock, first->deadline);
      continue;
    }
    EraseActive(first->id);
    std::string msg = TimeoutMessage(first);
    lock.unlock();
    FailCall(first, msg);
    lock.lock();
  }
}

void Engine::Impl::AddActive(const CallPtr& c) {
  if (active.empty()) busy_since = Clock::now();
  active[c->id] = c;
}

void Engine::Impl::EraseActive(uint64_t id) {
  if (active.erase(id) == 0 || !active.empty()) return;
  busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - busy_since).count();
}

void Engine::Impl::ReleaseIo(Call* c) {
  bool complete;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    complete = --c->io_refs == 0;
  }
  if (complete) Complete(c);
}

void Engine::Impl::ChunkDone(Call* c) {
  bool complete = false;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    if (--c->remaining == 0 && !c->base_released) {
      c->base_released = true;
      complete = --c->io_refs == 0;
    }
  }
  if (complete) Complete(c);
}

void Engine::Impl::FailCall(const CallPtr& c, const std::string& msg) {
  bool complete;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    if (c->base_released) return;
    c->base_released = true;
    c->error = msg;
    c->failed = true;
    complete = --c->io_refs == 0;
  }
  {
    // Forget its outstanding chunks: their sums, if they come, are drained.
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = pending.begin(); it != pending.end();) {
      it = it->second->call == c ? pending.erase(it) : std::next(it);
    }
  }
  if (complete) Complete(c.get());
}

void Engine::Impl::Complete(Call* c) {
  {
    std::lock_guard<std::mutex> lock(mu);
    EraseActive(c->id);
    // Matching trees get no answer: the check's entry goes with its call.
    auto it = pending.find(c->tree_round);
    if (it != pending.end() && it->second->call.get() == c) pending.erase(it);
  }
  if (c->failed) ++calls_failed;
  // A timed call's stages end when the caller is handed the result.
  std::optional<StageRecord> stage;
  if (c->timed) {
    std::lock_guard<std::mutex> lock(c->mu);
    stage = c->stage;
    stage->failed = c->failed;
  }
  if (c->early) {
    const int64_t handed = stage ? SteadyNs() : 0;
    if (c->early(c->error)) {
      if (stage) KeepStage(std::move(*stage), handed);
      return;
    }
  }
  std::function<void()> fn = [this, done = std::move(c->done), error = c->error, stage = std::move(stage)]() mutable {
    if (stage) KeepStage(std::move(*stage), SteadyNs());
    done(error);
  };
  std::lock_guard<std::mutex> lock(completer_mu);
  auto& completer = completers[c->spec.shard];
  if (!completer) completer = std::make_unique<Completer>();
  completer->Post(std::move(fn));
}

void Engine::Impl::KeepStage(StageRecord stage, int64_t done) {
  stage.done = done;
  std::lock_guard<std::mutex> lock(stages_mu);
  if (stages.size() < kMaxStageRecords) stages.push_back(std::move(stage));
}

// A data sum of a timed call is in its output: the call's stages follow its
// latest sum, with the server's own timings when it sent them.
void Engine::Impl::StampSum(Call* c, const FrameHeader& h, int64_t header_read) {
  const int64_t now = SteadyNs();
  std::lock_guard<std::mutex> lock(c->mu);
  if (header_read < c->stage.sum_arrived) return;
  c->stage.sum_arrived = header_read;
  c->stage.pulled = now;
  const bool timed = (h.flags & kFlagTimed) != 0;
  c->stage.server_ns = timed ? static_cast<int64_t>(h.aux) * kTimedUnitNs : 0;
  c->stage.peer_wait_ns = timed ? static_cast<int64_t>(h.sender) * kTimedUnitNs : 0;
}

// One record per part: a fused message shows up under each tensor it carried,
// with that tensor's bytes and priority and the message's times and key.
void Engine::Impl::Record(const Chunk& ch, double pulled) {
  std::lock_guard<std::mutex> lock(trace_mu);
  for (const Part& p : ch.parts) {
    // A bound on memory for long traced runs; the Python side says when it was hit.
    if (trace.size() >= kMaxTraceRecords) return;
    TraceRecord r;
    r.key = ch.key;
    r.round = ch.round;
    r.shard = ch.call->spec.shard;
    r.server = ch.server;
    r.priority = ch.call->spec.operands[p.op].priority;
    r.nbytes = p.nbytes;
    r.tensor = ch.call->TensorName(p.op);
    r.times = ch.times;
    r.times.pulled = pulled;
    trace.push_back(std::move(r));
  }
}

void Engine::Impl::ConnFailed(ServerConn* sc, const std::string& why) {
  std::vector<CallPtr> victims;
  bool quiet;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (sc->failed) return;
    sc->failed = true;
    sc->slot_cv.notify_all();
    quiet = stopping;
    inflight_chunks -= static_cast<int>(sc->unacked.size());
    sc->unacked.clear();
    for (auto& ch : sc->sendq) victims.push_back(ch->call);
    sc->sendq.clear();
    for (auto& kv : pending)
      if (kv.second->server == sc->index) victims.push_back(kv.second->call);
    sc->send_cv.notify_all();
    for (const Lost& l : DispatchLocked()) victims.push_back(l.call);  // its credits go to the others
  }
  ShutdownFd(sc->fd);  // wakes this connection's other thread
  const std::string msg = "jbps: lost summation server " + sc->addr.ToString() + ": " + why;
  if (quiet) {
    for (auto& c : victims) FailCall(c, msg);
    return;
  }
  // A job without one of its servers cannot sum: fail everything, now and later.
  SetFault(msg);
}

void Engine::Impl::SetFault(const std::string& msg) {
  std::vector<CallPtr> victims;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (stopping || !fault.empty()) return;
    fault = msg;
    for (auto& kv : active) victims.push_back(kv.second);
  }
  LogWarning("%s", msg.c_str());
  for (auto& c : victims) FailCall(c, msg);
}

}  // namespace jbps
