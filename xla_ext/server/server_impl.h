// The summation server's own types, shared by its files and by nothing else
// (server.h is the interface). A worker's connection (Conn) has a reader and
// a writer; pushes become tasks (Task) for the engine thread that owns their
// key, which adds them into the key's round (RoundState) and sends the sum.
// Who does what:
//   server.cc             start, stop, stats: the orchestration
//   server_admission.cc   the acceptor: hellos, authentication, shared-memory offers
//   server_connection.cc  a worker's connection: its reader, its writer, a lost worker
//   server_rounds.cc      rounds and summation on the engine threads
//   server_trees.cc       tree checks: do the workers' psums agree
//   server_memory.cc      where sums live (heap or the shared arena) and how long
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "codecs/onebit.h"
#include "codecs/topk.h"
#include "common/aligned_buffer.h"
#include "common/log.h"
#include "common/steady_clock.h"
#include "common/thread_name.h"
#include "kernels/sum_kernels.h"
#include "server/server.h"
#include "transport/net.h"
#include "transport/shm.h"
#include "wire/frame.h"
#include "wire/protocol.h"

namespace jbps {

using Clock = std::chrono::steady_clock;

// Bytes the server holds: a push, an accumulator, a sum.
class Block {
 public:
  virtual ~Block() = default;
  virtual char* data() = 0;
  virtual size_t size() const = 0;
  // Where the block lies in the sum arena, or -1 when it lies elsewhere.
  virtual int64_t arena_offset() const { return -1; }
};
using Payload = std::shared_ptr<Block>;

// Freed heap buffers of the sizes rounds use, kept for the next rounds: a
// fresh buffer's pages fault on first touch and go back to the kernel when
// it is freed, which took about a third of a compressed psum's CPU across
// hosts (each round's accumulator; perf on the emulated cluster). It keeps
// buffers of kMinBytes to kLargestBytes: malloc reuses smaller ones without
// faults, and a larger one would push every other out. At most kMaxBytes
// are kept, the oldest freed first to go.
class BufferPool {
 public:
  static constexpr size_t kMinBytes = size_t{64} << 10;
  static constexpr size_t kMaxBytes = size_t{32} << 20;
  static constexpr size_t kLargestBytes = kMaxBytes / 4;
  static bool Keeps(size_t n) { return n >= kMinBytes && n <= kLargestBytes; }
  // A buffer of exactly n bytes: a kept one when there is one, else a new one.
  std::unique_ptr<AlignedBuffer> Take(size_t n);
  void Give(std::unique_ptr<AlignedBuffer> buf);

 private:
  std::mutex mu_;
  std::deque<std::unique_ptr<AlignedBuffer>> free_;  // oldest first
  size_t bytes_ = 0;
};

class HeapBlock : public Block {
 public:
  explicit HeapBlock(size_t n) : buf_(std::make_unique<AlignedBuffer>(n)) {}
  // A buffer that goes back to `pool` when the block goes.
  HeapBlock(std::unique_ptr<AlignedBuffer> buf, std::shared_ptr<BufferPool> pool)
      : buf_(std::move(buf)), pool_(std::move(pool)) {}
  ~HeapBlock() override {
    if (pool_) pool_->Give(std::move(buf_));
  }
  char* data() override { return buf_->data(); }
  size_t size() const override { return buf_->size(); }

 private:
  std::unique_ptr<AlignedBuffer> buf_;
  std::shared_ptr<BufferPool> pool_;
};

// Bytes inside a shared region.
class RegionSlice : public Block {
 public:
  RegionSlice(std::shared_ptr<SharedRegion> region, uint64_t offset, size_t n)
      : region_(std::move(region)), offset_(offset), size_(n) {}
  char* data() override { return region_->data() + offset_; }
  size_t size() const override { return size_; }

 protected:
  std::shared_ptr<SharedRegion> region_;
  uint64_t offset_;
  size_t size_;
};

// A block of the sum arena, returned to it when the last reference goes.
class ArenaBlock : public RegionSlice {
 public:
  ArenaBlock(std::shared_ptr<Arena> arena, int64_t offset, size_t n)
      : RegionSlice(arena->region(), static_cast<uint64_t>(offset), n), arena_(std::move(arena)) {}
  ~ArenaBlock() override { arena_->Free(static_cast<int64_t>(offset_)); }
  int64_t arena_offset() const override { return static_cast<int64_t>(offset_); }

 private:
  std::shared_ptr<Arena> arena_;
};

// A push in a worker's shared region, read in place until its round ends.
using PushView = RegionSlice;

// Connections waiting to say hello, and how long they may take: beyond these
// the oldest is dropped, so silent or slow peers cannot pile up.
inline constexpr size_t kMaxPendingHellos = 256;
inline constexpr double kMaxHelloSeconds = 10;
// Refusals logged per second; the rest are counted and the count is logged.
inline constexpr int kLogsPerSecond = 10;
// Messages a connection's writer sends in one syscall (two iovecs each, well under IOV_MAX).
inline constexpr size_t kMaxWriteBatch = 64;
// A thread with a message for an idle connection (nothing queued, nothing
// being written) writes it itself when it is at most this big, instead of
// waking the connection's writer: a socket buffer takes it at once.
inline constexpr size_t kDirectWriteBytes = 64 << 10;
// A reader adds a push of at most this many bytes to its round itself when
// the key's summing thread is idle, instead of waking that thread.
inline constexpr uint64_t kInlineSumBytes = 1 << 20;

// One line per refusal, at most kLogsPerSecond a second: a flood of hostile
// connections cannot flood the log.
class RateLimitedLog {
 public:
  void Log(const std::string& line) {
    std::lock_guard<std::mutex> lock(mu_);
    auto now = Clock::now();
    if (now - window_ >= std::chrono::seconds(1)) {
      FlushLocked();
      window_ = now;
      in_window_ = 0;
    }
    if (in_window_ < kLogsPerSecond) {
      ++in_window_;
      LogWarning("%s", line.c_str());
    } else {
      ++suppressed_;
    }
  }
  void Flush() {
    std::lock_guard<std::mutex> lock(mu_);
    FlushLocked();
  }

 private:
  void FlushLocked() {
    if (suppressed_ > 0)
      LogWarning("jbps.server: %llu more refusals not logged (at most %d a second)",
                 static_cast<unsigned long long>(suppressed_), kLogsPerSecond);
    suppressed_ = 0;
  }
  std::mutex mu_;
  Clock::time_point window_{};
  int in_window_ = 0;
  uint64_t suppressed_ = 0;
};

// A connection that has not said hello yet: read by the acceptor alone.
struct Pending {
  int fd = -1;
  bool shm = false;     // on the shared-memory socket: a kShmOffer, not a hello
  bool parked = false;  // hello read, waiting for the rank's previous connection to end (AdmitHello)
  std::string peer;
  Clock::time_point deadline;
  FrameHeader hello;
  size_t got = 0;
};

struct OutMsg {
  FrameHeader header;
  Payload payload;   // shared by every worker receiving the same sum
  std::string text;  // error messages
  // A timed round's sum (kFlagTimed): its last push and this worker's push
  // read (SteadyNs), stamped into the header when it is written.
  int64_t last_read_ns = 0;
  int64_t own_read_ns = 0;
};

// Fills a timed sum's header just before it goes onto the socket.
inline void StampTimedSum(OutMsg& m) {
  if (m.last_read_ns == 0) return;
  auto units = [](int64_t ns) {
    return static_cast<uint32_t>(std::min<int64_t>(std::max<int64_t>(ns, 0) / kTimedUnitNs, UINT32_MAX));
  };
  m.header.flags |= kFlagTimed;
  m.header.aux = units(SteadyNs() - m.last_read_ns);
  m.header.sender = units(m.last_read_ns - m.own_read_ns);
}

// One worker's connection. The reader owns the receive side; the writer
// drains `out` so engine threads never block on a slow socket.
struct Conn {
  int fd = -1;
  std::string peer;
  uint32_t rank = UINT32_MAX;
  uint64_t epoch = 0;  // the job it belongs to (keep-alive servers serve several)
  std::mutex mu;
  std::condition_variable cv;
  std::deque<OutMsg> out;
  // Held while bytes go onto the socket: by the writer, or by a thread that
  // writes an acknowledgement itself while the writer is idle (Ack).
  std::mutex write_mu;
  bool closing = false;
  bool finishing = false;            // close once `out` is sent
  std::atomic<bool> aborted{false};  // closed by the server because the job failed
  std::atomic<bool> reader_done{false};
  std::atomic<bool> writer_done{false};
  // The worker's push region when it shares memory with this server (set
  // once by the acceptor, before the worker's first kPushShm), else null.
  std::shared_ptr<SharedRegion> push_region;
  std::atomic<bool> shm{false};
  // Tree descriptions this worker sent, by digest (kMaxDescribedTrees):
  // read and written by the reader alone.
  std::unordered_map<uint64_t, std::shared_ptr<const std::string>> trees;
  uint64_t tree_bytes = 0;
  std::thread reader;
  std::thread writer;

  void Send(OutMsg msg) {
    std::lock_guard<std::mutex> lock(mu);
    if (closing) return;
    out.push_back(std::move(msg));
    cv.notify_one();
  }
  // Sends `last` after what is queued, then closes.
  void Finish(OutMsg last) {
    std::lock_guard<std::mutex> lock(mu);
    if (closing || finishing) return;
    aborted = true;
    out.push_back(std::move(last));
    finishing = true;
    cv.notify_one();
  }
  void Close() {
    std::lock_guard<std::mutex> lock(mu);
    closing = true;
    ShutdownFd(fd);
    cv.notify_all();
  }
};
using ConnPtr = std::shared_ptr<Conn>;

struct Task {
  uint64_t key;
  uint32_t round;
  DType dtype;
  uint32_t rank;
  Payload data;
  ConnPtr conn;
  uint32_t digest = 0;     // of the call's tree (a push's aux)
  bool ack_after = false;  // a shared-memory push: acknowledged once added, which frees its slot
  int64_t read_ns = 0;     // a timed push (kFlagTimed): when its header was read
  uint16_t param = 0;      // the dtype's parameter (topk's values per record)
};

// A key's round in one job (keep-alive servers serve several).
struct JobRoundKey {
  uint64_t epoch;
  uint64_t key;
  uint32_t round;
  bool operator==(const JobRoundKey& o) const { return epoch == o.epoch && key == o.key && round == o.round; }
};
struct JobRoundKeyHash {
  size_t operator()(const JobRoundKey& k) const { return (k.key * 31 + k.round) * 31 + k.epoch; }
};

// One call's tree check, until every worker has sent its digest.
struct TreeRound {
  uint64_t digest = 0;
  uint32_t first_rank = 0;
  std::shared_ptr<const std::string> first_text;
  std::vector<bool> checked;
  int count = 0;
  std::vector<ConnPtr> waiters;
  std::string error;
};

// A sum in the arena that shared-memory workers are still copying out.
struct Hold {
  Payload sum;
  int readers = 0;
};

// The sum of one key in one round, until every worker has pushed it.
struct RoundState {
  DType dtype = DType::kF32;
  uint16_t param = 0;  // the dtype's (dtype.h): every push of the round must carry the same
  uint64_t nbytes = 0;
  uint32_t first_rank = 0;
  int pushes = 0;
  int folded = 0;  // pushes added into acc
  std::vector<bool> pushed;
  Payload acc;
  // Pushes not yet added: in arrival order, or by rank when deterministic
  // (onebit and topk: every push of the round, until FinishSum sums them).
  // Shared-memory pushes wait here in place: a worker frees a slot only when
  // the round's sum (or error) arrives, so nothing is copied to keep them.
  std::vector<Payload> held;
  std::vector<ConnPtr> waiters;
  std::string error;
  uint8_t error_flags = 0;  // kFlagTreeMismatch when the pushes show the workers' trees differ
  uint32_t digest = 0;      // the first push's tree digest: every push must carry it
  // Timed pushes (kFlagTimed): each waiter's read time, and the latest.
  std::vector<int64_t> read_ns;
  int64_t last_read_ns = 0;
  int64_t first_ns = 0;      // when its first push was taken (SteadyNs)
  bool stall_noted = false;  // kStall sent to the workers that pushed (NoteStalls)
};

struct SumThread {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> queue;
  bool stop = false;
  std::thread thread;
  // Held by whichever thread adds pushes to this thread's rounds: `thread`,
  // or a reader whose push found the queue empty (RunTask).
  std::mutex run_mu;
  std::atomic<bool> reader_running{false};  // run_mu is a reader's, for a small push
  // Guarded by run_mu.
  std::unordered_map<RoundKey, RoundState, RoundKeyHash> rounds;
  // Per onebit or topk key: what encoding its sums lost so far (error
  // feedback), added to its next sum. A new job starts from zeros.
  std::unordered_map<uint64_t, std::vector<float>> residuals;
  std::atomic<uint64_t> epoch{0};  // rounds of older jobs are dropped; written under run_mu
  int64_t next_stall_scan_ns = 0;  // guarded by run_mu (NoteStalls)
  uint64_t next_epoch = 0;         // guarded by mu: a job ended, drop its rounds now (DropEndedJobs)
};

struct SummationServer::Impl {
  ServerOptions opt;
  int listen_fd = -1;
  int wake_pipe[2] = {-1, -1};  // Stop() wakes the acceptor's poll through it
  int port = 0;
  int stall_ms = 60000;
  // When every worker must have connected (join_timeout_s); max(): no bound, or checked already.
  Clock::time_point join_deadline = Clock::time_point::max();
  std::thread acceptor;
  std::vector<std::unique_ptr<SumThread>> sum_threads;
  RateLimitedLog refusals;

  std::mutex bind_mu;  // guards key_thread, thread_bytes
  std::unordered_map<uint64_t, size_t> key_thread;
  std::vector<uint64_t> thread_bytes;

  std::mutex mu;  // guards conns, connected, said_bye, byes, epoch, finished, failure
  std::condition_variable finished_cv;
  std::list<ConnPtr> conns;
  std::vector<bool> connected;
  std::vector<bool> joined;  // connected at least once: the join deadline's record
  std::vector<bool> said_bye;
  int byes = 0;
  uint64_t epoch = 0;
  bool finished = false;
  std::string failure;
  std::atomic<bool> stopping{false};

  std::atomic<uint64_t> pushes{0}, bytes_received{0}, sums_sent{0}, rejected{0}, workers_lost{0}, bytes_shm{0};

  // Shared memory (shm.h): the sum arena every colocated worker maps, the
  // socket its descriptor is handed out on, and this server's instance id
  // (which names that socket; workers learn it from the hello reply).
  std::shared_ptr<Arena> arena;
  int shm_fd = -1;
  uint64_t instance = 0;
  std::atomic<int> shm_workers{0};
  std::mutex holds_mu;
  std::unordered_map<JobRoundKey, Hold, JobRoundKeyHash> holds;

  // Heap blocks' buffers, reused round after round (HeapBlockOf).
  std::shared_ptr<BufferPool> buffers = std::make_shared<BufferPool>();

  // Route epochs (kRoutes): the latest each worker of job `routes_job` has
  // announced (under routes_mu); a sum carries the least of them, kept as
  // (the job's low 32 bits << 32 | that epoch) for ReadyRoutes.
  std::mutex routes_mu;
  uint64_t routes_job = 0;
  std::vector<uint32_t> announced_routes;
  std::atomic<uint64_t> ready_routes{0};
  void AnnounceRoutes(const ConnPtr& c, uint64_t epoch);
  uint32_t ReadyRoutes(uint64_t job) const;

  // Tree checks waiting for some worker's digest (CheckTree).
  std::mutex trees_mu;
  std::unordered_map<JobRoundKey, TreeRound, JobRoundKeyHash> tree_rounds;

  void AcceptLoop();
  void ReadHello(Pending& p, bool* done);
  bool AdmitHello(Pending& p, bool last_try);
  void ReadShmOffer(Pending& p);
  Payload NewBlock(size_t n);
  Payload HeapBlockOf(size_t n);
  Payload InArena(Payload p);
  void Release(const ConnPtr& c, const FrameHeader& h);
  void DropEndedJobs(uint64_t before_epoch);
  void Ack(const ConnPtr& c, uint64_t key, uint32_t round);
  void ReaderLoop(ConnPtr c);
  void WriterLoop(ConnPtr c);
  void SumLoop(SumThread* e);
  void Refuse(const std::string& peer, const std::string& why);
  void WorkerLost(const ConnPtr& c, const std::string& what);
  void CheckJoined();
  void Abort(const std::vector<ConnPtr>& others, const std::string& msg);
  void FailJob(std::vector<ConnPtr> others, const std::string& msg);
  Payload RecvPayload(FrameReader* reader, uint64_t nbytes, std::string* why);
  Payload ShmPush(const ConnPtr& c, const Frame& f, std::string* why);
  void Process(Task& t, SumThread* e);
  void Fold(RoundState& st);
  Payload FinishSum(RoundState& st, SumThread* e, uint64_t key);
  SumThread* ThreadFor(uint64_t key, uint64_t nbytes);
  void SendError(const ConnPtr& c, uint64_t key, uint32_t round, const std::string& msg, uint8_t flags = 0);
  void Deliver(const ConnPtr& c, OutMsg m);
  bool ReadTreeCheck(const ConnPtr& c, const FrameHeader& h, FrameReader* reader, std::string* why);
  void CheckTree(const ConnPtr& c, const FrameHeader& h, uint64_t digest, std::shared_ptr<const std::string> text);
  void RunTask(SumThread* e, Task& t);
  void NoteStalls(SumThread* e);
  int64_t StallNoteNs() const;
  void ReapFinishedConns();
  void MarkFinished();
  std::string Name() const { return opt.bind.substr(0, opt.bind.rfind(':')) + ":" + std::to_string(port); }
};

}  // namespace jbps
