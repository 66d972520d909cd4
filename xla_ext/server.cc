#include "server.h"

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
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "aligned_buffer.h"
#include "log.h"
#include "net.h"
#include "onebit.h"
#include "protocol.h"
#include "shm.h"
#include "steady_clock.h"
#include "sum_kernels.h"
#include "thread_name.h"

namespace jbps {
namespace {

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

class HeapBlock : public Block {
 public:
  explicit HeapBlock(size_t n) : buf_(n) {}
  char* data() override { return buf_.data(); }
  size_t size() const override { return buf_.size(); }

 private:
  AlignedBuffer buf_;
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
constexpr size_t kMaxPendingHellos = 256;
constexpr double kMaxHelloSeconds = 10;
// Refusals logged per second; the rest are counted and the count is logged.
constexpr int kLogsPerSecond = 10;
// Messages a connection's writer sends in one syscall (two iovecs each, well under IOV_MAX).
constexpr size_t kMaxWriteBatch = 64;
// A thread with a message for an idle connection (nothing queued, nothing
// being written) writes it itself when it is at most this big, instead of
// waking the connection's writer: a socket buffer takes it at once.
constexpr size_t kDirectWriteBytes = 64 << 10;
// A reader adds a push of at most this many bytes to its round itself when
// the key's summing thread is idle, instead of waking that thread.
constexpr uint64_t kInlineSumBytes = 1 << 20;

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

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// Names the first leaf where two workers' trees differ. A tree is "psum NAME"
// then one "PATH DTYPE[SHAPE]" line per leaf (jbps/ops/psum.py).
std::string TreeDifference(uint32_t rank_a, const std::string& a, uint32_t rank_b, const std::string& b) {
  const auto la = Lines(a), lb = Lines(b);
  const std::string wa = "worker " + std::to_string(rank_a), wb = "worker " + std::to_string(rank_b);
  const std::string call = la[0].rfind("psum ", 0) == 0 ? la[0].substr(5) : la[0];
  std::string msg = "workers disagree on the tree of psum '" + call + "': ";
  auto split = [](const std::string& line) {
    size_t sp = line.rfind(' ');
    return sp == std::string::npos ? std::make_pair(line, std::string()) : std::make_pair(line.substr(0, sp), line.substr(sp + 1));
  };
  for (size_t i = 1; i < std::max(la.size(), lb.size()); ++i) {
    if (i < la.size() && i < lb.size() && la[i] == lb[i]) continue;
    if (i < la.size() && i < lb.size() && split(la[i]).first == split(lb[i]).first) {
      return msg + "tensor '" + call + split(la[i]).first + "': " + wa + " has " + split(la[i]).second + ", " + wb +
             " has " + split(lb[i]).second;
    }
    auto leaf = [&](const std::vector<std::string>& l) {
      return i < l.size() ? "tensor '" + call + split(l[i]).first + "' " + split(l[i]).second : std::string("nothing");
    };
    return msg + wa + " has " + std::to_string(la.size() - 1) + " leaves, " + wb + " has " + std::to_string(lb.size() - 1) +
           "; leaf " + std::to_string(i - 1) + ": " + wa + " has " + leaf(la) + ", " + wb + " has " + leaf(lb);
  }
  return msg + "the descriptions differ (" + wa + ": " + std::to_string(a.size()) + " bytes, " + wb + ": " +
         std::to_string(b.size()) + " bytes)";
}

// A connection that has not said hello yet: read by the acceptor alone.
struct Pending {
  int fd = -1;
  bool shm = false;  // on the shared-memory socket: a kShmOffer, not a hello
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
void StampTimedSum(OutMsg& m) {
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
  bool finishing = false;         // close once `out` is sent
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
  uint64_t nbytes = 0;
  uint32_t first_rank = 0;
  int pushes = 0;
  int folded = 0;  // pushes added into acc
  std::vector<bool> pushed;
  Payload acc;
  // Pushes not yet added: in arrival order, or by rank when deterministic.
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
};

struct EngineThread {
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
  // Per onebit key: what encoding its sums lost so far (error feedback),
  // added to its next sum. A new job starts from zeros.
  std::unordered_map<uint64_t, std::vector<float>> onebit_residuals;
  std::atomic<uint64_t> epoch{0};  // rounds of older jobs are dropped; written under run_mu
  uint64_t next_epoch = 0;  // guarded by mu: a job ended, drop its rounds now (DropEndedJobs)
};

}  // namespace

struct SummationServer::Impl {
  ServerOptions opt;
  int listen_fd = -1;
  int wake_pipe[2] = {-1, -1};  // Stop() wakes the acceptor's poll through it
  int port = 0;
  int stall_ms = 60000;
  std::thread acceptor;
  std::vector<std::unique_ptr<EngineThread>> engines;
  RateLimitedLog refusals;

  std::mutex bind_mu;  // guards key_thread, thread_bytes
  std::unordered_map<uint64_t, size_t> key_thread;
  std::vector<uint64_t> thread_bytes;

  std::mutex mu;  // guards conns, connected, said_bye, byes, epoch, finished, failure
  std::condition_variable finished_cv;
  std::list<ConnPtr> conns;
  std::vector<bool> connected;
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

  // Tree checks waiting for some worker's digest (CheckTree).
  std::mutex trees_mu;
  std::unordered_map<JobRoundKey, TreeRound, JobRoundKeyHash> tree_rounds;

  void AcceptLoop();
  void Accept(std::list<Pending>* pending);
  void ReadHello(Pending& p, bool* done);
  bool AdmitHello(Pending& p, bool last_try);
  void ReadShmOffer(Pending& p);
  Payload NewBlock(size_t n);
  Payload InArena(Payload p);
  void Release(const ConnPtr& c, const FrameHeader& h);
  void DropEndedJobs(uint64_t before_epoch);
  void Ack(const ConnPtr& c, uint64_t key, uint32_t round);
  void ReaderLoop(ConnPtr c);
  void WriterLoop(ConnPtr c);
  void EngineLoop(EngineThread* e);
  void Refuse(const std::string& peer, const std::string& why);
  void WorkerLost(const ConnPtr& c, const std::string& what);
  Payload RecvPayload(const ConnPtr& c, uint64_t nbytes, std::string* why);
  void Process(Task& t, EngineThread* e);
  void Fold(RoundState& st, DType dtype);
  EngineThread* ThreadFor(uint64_t key, uint64_t nbytes);
  void SendError(const ConnPtr& c, uint64_t key, uint32_t round, const std::string& msg, uint8_t flags = 0);
  void Deliver(const ConnPtr& c, OutMsg m);
  bool ReadTreeCheck(const ConnPtr& c, const FrameHeader& h, std::string* why);
  void CheckTree(const ConnPtr& c, const FrameHeader& h, uint64_t digest, std::shared_ptr<const std::string> text);
  void RunTask(EngineThread* e, Task& t);
  void ReapFinishedConns();
  void MarkFinished();
  std::string Name() const { return opt.bind.substr(0, opt.bind.rfind(':')) + ":" + std::to_string(port); }
};

SummationServer::SummationServer(ServerOptions options) : impl_(new Impl) {
  impl_->opt = std::move(options);
}

SummationServer::~SummationServer() { Stop(); }

bool SummationServer::Start(std::string* err) {
  Impl& s = *impl_;
  if (s.opt.num_workers < 1) {
    *err = "num_workers must be at least 1";
    return false;
  }
  HostPort hp;
  if (!ParseHostPort(s.opt.bind, &hp, err)) return false;
  s.listen_fd = Listen(hp, &s.port, err);
  if (s.listen_fd < 0) return false;
  // Non-blocking: a connection reset between poll and accept must not block the acceptor.
  ::fcntl(s.listen_fd, F_SETFL, ::fcntl(s.listen_fd, F_GETFL, 0) | O_NONBLOCK);
  if (::pipe2(s.wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    *err = "cannot create a pipe";
    CloseFd(s.listen_fd);
    return false;
  }
  s.stall_ms = static_cast<int>(std::min(s.opt.timeout_s * 1000, 2e9));
  s.connected.assign(s.opt.num_workers, false);
  s.said_bye.assign(s.opt.num_workers, false);
  int n = s.opt.engine_threads;
  if (n <= 0) n = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
  for (int i = 0; i < n; ++i) {
    s.engines.emplace_back(new EngineThread);
    EngineThread* e = s.engines.back().get();
    e->thread = std::thread([&s, e] { s.EngineLoop(e); });
  }
  s.thread_bytes.assign(s.engines.size(), 0);
  if (s.opt.shm_arena_bytes > 0) {
    std::random_device rd;
    s.instance = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
    std::string why;
    auto region = SharedRegion::Create(s.opt.shm_arena_bytes, "jbps-sums", &why);
    if (region) s.shm_fd = ListenShmSocket(ShmSocketName(s.opt.token, s.instance), &why);
    if (region && s.shm_fd >= 0) {
      s.arena = std::make_shared<Arena>(std::move(region));
    } else {
      LogWarning("jbps.server: no shared memory for colocated workers (%s); they will use TCP", why.c_str());
    }
  }
  s.acceptor = std::thread([&s] { s.AcceptLoop(); });
  return true;
}

int SummationServer::port() const { return impl_->port; }

bool SummationServer::WaitFor(double seconds) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  return impl_->finished_cv.wait_for(lock, std::chrono::duration<double>(seconds),
                                     [this] { return impl_->finished; });
}

std::string SummationServer::failure() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->failure;
}

void SummationServer::Stop() {
  Impl& s = *impl_;
  if (s.stopping.exchange(true)) return;
  if (s.wake_pipe[1] >= 0) {
    ssize_t ignored = ::write(s.wake_pipe[1], "x", 1);
    (void)ignored;
  }
  if (s.acceptor.joinable()) s.acceptor.join();
  std::list<ConnPtr> conns;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    conns.swap(s.conns);
  }
  for (auto& c : conns) c->Close();
  for (auto& c : conns) {
    if (c->reader.joinable()) c->reader.join();
    if (c->writer.joinable()) c->writer.join();
    CloseFd(c->fd);
  }
  for (auto& e : s.engines) {
    {
      std::lock_guard<std::mutex> lock(e->mu);
      e->stop = true;
    }
    e->cv.notify_all();
    if (e->thread.joinable()) e->thread.join();
    e->rounds.clear();  // drops the last references to connections
  }
  CloseFd(s.listen_fd);
  s.listen_fd = -1;
  CloseFd(s.shm_fd);
  s.shm_fd = -1;
  {
    std::lock_guard<std::mutex> lock(s.holds_mu);
    s.holds.clear();
  }
  {
    std::lock_guard<std::mutex> lock(s.trees_mu);
    s.tree_rounds.clear();  // drops their references to connections
  }
  s.arena.reset();  // its memfd goes once the last block does
  for (int& fd : s.wake_pipe) {
    CloseFd(fd);
    fd = -1;
  }
  s.refusals.Flush();
  s.MarkFinished();
}

ServerStats SummationServer::stats() const {
  ServerStats st;
  st.pushes = impl_->pushes.load();
  st.bytes_received = impl_->bytes_received.load();
  st.sums_sent = impl_->sums_sent.load();
  st.rejected = impl_->rejected.load();
  st.workers_lost = impl_->workers_lost.load();
  st.bytes_shm = impl_->bytes_shm.load();
  st.shm_workers = static_cast<uint64_t>(std::max(0, impl_->shm_workers.load()));
  std::lock_guard<std::mutex> lock(impl_->bind_mu);
  st.thread_bytes = impl_->thread_bytes;
  return st;
}

void SummationServer::Impl::MarkFinished() {
  std::lock_guard<std::mutex> lock(mu);
  finished = true;
  finished_cv.notify_all();
}

void SummationServer::Impl::Refuse(const std::string& peer, const std::string& why) {
  ++rejected;
  refusals.Log("jbps.server: refused connection from " + peer + ": " + why);
}

// The acceptor: one poll over the listening socket and every connection that
// has not said hello yet. Only an authenticated connection gets threads.
void SummationServer::Impl::AcceptLoop() {
  NameThisThread("jbps-accept");
  std::list<Pending> pending;
  const double hello_s = std::min(opt.timeout_s, kMaxHelloSeconds);
  std::vector<struct pollfd> fds;
  while (!stopping) {
    fds.clear();
    fds.push_back({wake_pipe[0], POLLIN, 0});
    fds.push_back({listen_fd, POLLIN, 0});
    fds.push_back({shm_fd, static_cast<short>(shm_fd >= 0 ? POLLIN : 0), 0});  // poll ignores fd -1
    auto soonest = Clock::now() + std::chrono::seconds(1);
    for (auto& p : pending) {
      fds.push_back({p.fd, static_cast<short>(p.parked ? 0 : POLLIN), 0});
      soonest = std::min(soonest, p.parked ? Clock::now() + std::chrono::milliseconds(2) : p.deadline);
    }
    int wait_ms = static_cast<int>(
        std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(soonest - Clock::now()).count()));
    int rc = ::poll(fds.data(), fds.size(), wait_ms + 1);
    if (rc < 0 && errno != EINTR) break;
    if (stopping || (rc > 0 && fds[0].revents)) break;
    // Hellos first (their fds are in `fds` in list order), then new connections.
    size_t i = 3;
    const auto now = Clock::now();
    for (auto it = pending.begin(); it != pending.end(); ++i) {
      bool done = false;
      if (it->parked && fds[i].revents) {  // closed (or erred) while parked
        Refuse(it->peer, "closed while waiting to be admitted");
        CloseFd(it->fd);
        done = true;
      } else if (it->parked) {
        done = AdmitHello(*it, /*last_try=*/now >= it->deadline);
      } else if (fds[i].revents && it->shm) {
        ReadShmOffer(*it);
        done = true;
      } else if (fds[i].revents) {
        ReadHello(*it, &done);
      } else if (now >= it->deadline) {
        Refuse(it->peer, "no hello within " + std::to_string(static_cast<int>(hello_s)) + " s");
        CloseFd(it->fd);
        done = true;
      }
      it = done ? pending.erase(it) : std::next(it);
    }
    for (int side = 1; side <= 2; ++side) {
      if (!fds[side].revents) continue;
      ReapFinishedConns();
      for (int k = 0; k < 64; ++k) {  // a burst at a time, then the hellos again
        int fd = ::accept4(fds[side].fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
          // Out of descriptors: back off instead of spinning.
          if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(std::chrono::milliseconds(50));
          break;
        }
        if (pending.size() >= kMaxPendingHellos) {
          Refuse(pending.front().peer, "too many connections waiting to say hello");
          CloseFd(pending.front().fd);
          pending.pop_front();
        }
        Pending p;
        p.fd = fd;
        p.shm = side == 2;
        if (!p.shm) TuneSocket(fd);  // no Nagle: a small ack queued before a sum must not wait out a delayed ACK
        p.peer = p.shm ? "the shared-memory socket" : PeerName(fd);
        p.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(hello_s));
        pending.push_back(std::move(p));
      }
    }
  }
  for (auto& p : pending) CloseFd(p.fd);
}

void SummationServer::Impl::ReadHello(Pending& p, bool* done) {
  ssize_t r = ::recv(p.fd, reinterpret_cast<char*>(&p.hello) + p.got, sizeof(p.hello) - p.got, 0);
  if (r < 0 && (errno == EAGAIN || errno == EINTR)) return;
  *done = true;
  if (r <= 0) {
    Refuse(p.peer, p.got == 0 ? "closed without a hello" : "closed in the middle of its hello");
    CloseFd(p.fd);
    return;
  }
  p.got += static_cast<size_t>(r);
  if (p.got < sizeof(p.hello)) {
    *done = false;
    return;
  }
  *done = AdmitHello(p, /*last_try=*/false);
  p.parked = !*done;
}

// Admits (or refuses, saying why) a connection whose hello is complete.
// Returns false to park it: on a keep-alive server, a worker of the next job
// may reconnect before the server has read its previous connection's
// goodbye; the acceptor tries again until its hello deadline.
bool SummationServer::Impl::AdmitHello(Pending& p, bool last_try) {
  const FrameHeader& h = p.hello;
  std::string why = ValidateHeader(h, opt.token);
  if (why.empty() && h.type != static_cast<uint16_t>(MsgType::kHello)) why = "first message is not a hello";
  if (!why.empty()) {  // said to no one: the peer may not even hold the token
    Refuse(p.peer, why);
    CloseFd(p.fd);
    return true;
  }
  // From here on the peer has the job token, so it gets told why it is refused.
  uint64_t conn_epoch = 0;
  if (h.key != static_cast<uint64_t>(opt.num_workers)) {
    why = "worker expects " + std::to_string(h.key) + " workers, this server was started with --num-workers " +
          std::to_string(opt.num_workers);
  } else if (h.sender >= static_cast<uint32_t>(opt.num_workers)) {
    why = "worker rank " + std::to_string(h.sender) + " out of range for " + std::to_string(opt.num_workers) +
          " workers";
  } else {
    std::lock_guard<std::mutex> lock(mu);
    if (connected[h.sender] && opt.keep_alive && !last_try) {
      return false;
    } else if (connected[h.sender]) {
      why = "worker rank " + std::to_string(h.sender) + " is already connected";
    } else if (finished) {
      why = "this server's job has ended";
    } else {
      connected[h.sender] = true;
      // A worker that already said goodbye in this job is early for the next one.
      conn_epoch = opt.keep_alive && said_bye[h.sender] ? epoch + 1 : epoch;
    }
  }
  if (!why.empty()) {
    Refuse(p.peer, why);
    // Written here, not queued: the connection closes right after. A short
    // bound: it fits the socket buffer unless the peer is hostile.
    FrameHeader eh = MakeHeader(MsgType::kError, opt.token);
    eh.nbytes = why.size();
    struct iovec iov[2] = {{&eh, sizeof(eh)}, {const_cast<char*>(why.data()), why.size()}};
    SendAll(p.fd, iov, 2, 1000);
    CloseFd(p.fd);
    return true;
  }
  auto c = std::make_shared<Conn>();
  c->fd = p.fd;
  c->peer = p.peer;
  c->rank = h.sender;
  c->epoch = conn_epoch;
  SetLiveness(c->fd, opt.timeout_s);
  FrameHeader ok = MakeHeader(MsgType::kHelloOk, opt.token);
  ok.key = static_cast<uint64_t>(opt.role);
  if (arena) {  // where to offer shared memory (shm.h); 0 when there is none
    ok.sender = static_cast<uint32_t>(instance);
    ok.round = static_cast<uint32_t>(instance >> 32);
  }
  c->Send(OutMsg{ok, nullptr, {}});
  std::lock_guard<std::mutex> lock(mu);
  conns.push_back(c);
  c->reader = std::thread([this, c] { ReaderLoop(c); });
  c->writer = std::thread([this, c] { WriterLoop(c); });
  return true;
}

// A worker on this host offers its push region (a sealed memfd) on the
// shared-memory socket; the server maps it read-only, binds it to that
// worker's connection and answers with its sum arena. Read by the acceptor,
// so the offer must be there when the socket turns readable (one
// SOCK_SEQPACKET message, sent right after connecting).
void SummationServer::Impl::ReadShmOffer(Pending& p) {
  char buf[sizeof(FrameHeader) + 16];
  int fd = -1;
  ssize_t n = RecvWithFd(p.fd, buf, sizeof(buf), &fd, 0);
  FrameHeader h;
  std::string why;
  if (n != static_cast<ssize_t>(sizeof(h))) {
    why = "not a shared-memory offer";
  } else {
    std::memcpy(&h, buf, sizeof(h));
    why = ValidateHeader(h, opt.token);
    if (why.empty() && h.type != static_cast<uint16_t>(MsgType::kShmOffer)) why = "not a shared-memory offer";
  }
  if (!why.empty()) {  // said to no one: the peer may not hold the token
    if (fd >= 0) CloseFd(fd);
    Refuse(p.peer, why);
    CloseFd(p.fd);
    return;
  }
  ConnPtr conn;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& c : conns)
      if (c->rank == h.sender && c->epoch == epoch && !c->reader_done) conn = c;
  }
  std::shared_ptr<SharedRegion> region;
  if (fd < 0) {
    why = "the offer carried no region";
  } else if (!conn) {
    why = "worker " + std::to_string(h.sender) + " has no connection to this server";
    CloseFd(fd);
  } else if (h.key < 4096 || h.key > opt.max_payload_bytes) {
    why = "push slots of " + std::to_string(h.key) + " bytes";
    CloseFd(fd);
  } else if ((region = SharedRegion::Attach(fd, &why)) == nullptr) {
    // Attach closed fd and said why.
  } else {
    std::lock_guard<std::mutex> lock(conn->mu);
    if (conn->closing) {
      why = "worker " + std::to_string(h.sender) + "'s connection is closing";
    } else if (conn->push_region) {
      why = "worker " + std::to_string(h.sender) + " already shares memory with this server";
    } else {
      conn->push_region = region;
      conn->shm.store(true, std::memory_order_release);
      ++shm_workers;
    }
  }
  FrameHeader reply = MakeHeader(why.empty() ? MsgType::kShmAccept : MsgType::kError, opt.token);
  if (!why.empty()) Refuse(p.peer, "worker " + std::to_string(h.sender) + ": " + why);
  // SOCK_SEQPACKET keeps header and message one datagram; the worker reads both at once.
  std::string msg(reinterpret_cast<const char*>(&reply), sizeof(reply));
  if (!why.empty()) {
    reply.nbytes = std::min<size_t>(why.size(), 1024);
    msg.assign(reinterpret_cast<const char*>(&reply), sizeof(reply));
    msg += why.substr(0, reply.nbytes);
  }
  SendWithFd(p.fd, msg.data(), msg.size(), why.empty() ? arena->region()->fd() : -1, 1000);
  CloseFd(p.fd);
}

Payload SummationServer::Impl::NewBlock(size_t n) {
  // In the arena while some worker can read sums there; on the heap otherwise.
  if (arena && shm_workers.load() > 0) {
    int64_t offset = arena->Allocate(n);
    if (offset >= 0) return std::make_shared<ArenaBlock>(arena, offset, n);
  }
  return std::make_shared<HeapBlock>(n);
}

Payload SummationServer::Impl::InArena(Payload p) {
  if (!arena || p->arena_offset() >= 0) return p;
  int64_t offset = arena->Allocate(p->size());
  if (offset < 0) return p;  // arena full: this sum goes over TCP
  auto block = std::make_shared<ArenaBlock>(arena, offset, p->size());
  std::memcpy(block->data(), p->data(), p->size());
  return block;
}

void SummationServer::Impl::Ack(const ConnPtr& c, uint64_t key, uint32_t round) {
  FrameHeader ack = MakeHeader(MsgType::kPushAck, opt.token);
  ack.key = key;
  ack.round = round;
  Deliver(c, OutMsg{ack, nullptr, {}});  // on the worker's credit loop
}

// Reads a tree check's payload and checks it (CheckTree). False, with *why,
// when the message is bad.
bool SummationServer::Impl::ReadTreeCheck(const ConnPtr& c, const FrameHeader& h, std::string* why) {
  std::string payload(h.nbytes, '\0');  // bounded by ValidateHeader
  IoStatus st = RecvAll(c->fd, payload.data(), payload.size(), stall_ms, stall_ms);
  if (st != IoStatus::kOk) {
    *why = std::string("truncated tree check: ") + IoStatusName(st);
    return false;
  }
  uint64_t digest;
  std::memcpy(&digest, payload.data(), sizeof(digest));
  std::shared_ptr<const std::string> text;
  if (payload.size() > kTreeDigestBytes) {
    text = std::make_shared<const std::string>(payload, kTreeDigestBytes);
    // Kept while within the bounds, as the worker counts them: it sends this
    // tree's digest alone from now on.
    if (c->trees.count(digest) == 0 && c->trees.size() < kMaxDescribedTrees &&
        c->tree_bytes + text->size() <= kMaxDescribedTreeBytes) {
      c->trees.emplace(digest, text);
      c->tree_bytes += text->size();
    }
  } else {
    auto it = c->trees.find(digest);
    if (it == c->trees.end()) {
      *why = "a tree check of a tree it never described";
      return false;
    }
    text = it->second;
  }
  CheckTree(c, h, digest, std::move(text));
  return true;
}

// Every worker sends its call's tree digest under the call's tree key and
// round: while they agree nobody is answered (each push carries the digest,
// and a round of pushes that disagree gets no sum), and once they differ
// every worker's check fails, naming the first leaf that differs.
void SummationServer::Impl::CheckTree(const ConnPtr& c, const FrameHeader& h, uint64_t digest,
                                      std::shared_ptr<const std::string> text) {
  std::vector<std::pair<ConnPtr, std::string>> errors;
  {
    std::lock_guard<std::mutex> lock(trees_mu);
    const JobRoundKey k{c->epoch, h.key, h.round};
    auto it = tree_rounds.find(k);
    if (it == tree_rounds.end()) {
      if (tree_rounds.size() >= opt.max_keys) {
        errors.emplace_back(c, "the server already waits on " + std::to_string(opt.max_keys) +
                                   " tree checks, its limit");
      } else {
        it = tree_rounds.emplace(k, TreeRound{}).first;
        it->second.digest = digest;
        it->second.first_rank = c->rank;
        it->second.first_text = text;
        it->second.checked.assign(opt.num_workers, false);
      }
    }
    if (it != tree_rounds.end()) {
      TreeRound& r = it->second;
      if (r.checked[c->rank]) {
        errors.emplace_back(c, "duplicate tree check of round " + std::to_string(h.round) + " from worker " +
                                   std::to_string(c->rank));
      } else {
        r.checked[c->rank] = true;
        ++r.count;
        r.waiters.push_back(c);
        if (r.error.empty() && digest != r.digest) {
          r.error = TreeDifference(r.first_rank, *r.first_text, c->rank, *text);
          for (auto& w : r.waiters) errors.emplace_back(w, r.error);
        } else if (!r.error.empty()) {
          errors.emplace_back(c, r.error);
        }
        if (r.count == opt.num_workers) tree_rounds.erase(it);
      }
    }
  }
  for (auto& [w, msg] : errors) SendError(w, h.key, h.round, msg);
}

void SummationServer::Impl::Release(const ConnPtr& c, const FrameHeader& h) {
  std::lock_guard<std::mutex> lock(holds_mu);
  auto it = holds.find(JobRoundKey{c->epoch, h.key, h.round});
  if (it != holds.end() && --it->second.readers == 0) holds.erase(it);  // the block goes back to the arena
}

// A job ended (keep-alive servers go on): its sums still held for readers,
// and its unfinished rounds with the pushes they read in place, go now, so
// no departed worker's region stays mapped.
void SummationServer::Impl::DropEndedJobs(uint64_t before_epoch) {
  {
    std::lock_guard<std::mutex> lock(holds_mu);
    for (auto it = holds.begin(); it != holds.end();) it = it->first.epoch < before_epoch ? holds.erase(it) : std::next(it);
  }
  {
    std::lock_guard<std::mutex> lock(trees_mu);
    for (auto it = tree_rounds.begin(); it != tree_rounds.end();)
      it = it->first.epoch < before_epoch ? tree_rounds.erase(it) : std::next(it);
  }
  for (auto& e : engines) {
    {
      std::lock_guard<std::mutex> lock(e->mu);
      e->next_epoch = std::max(e->next_epoch, before_epoch);
    }
    e->cv.notify_one();
  }
}

void SummationServer::Impl::ReapFinishedConns() {
  std::list<ConnPtr> done;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = conns.begin(); it != conns.end();) {
      if ((*it)->reader_done && (*it)->writer_done) {
        done.push_back(*it);
        it = conns.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : done) {
    c->reader.join();
    c->writer.join();
    CloseFd(c->fd);
  }
}

Payload SummationServer::Impl::RecvPayload(const ConnPtr& c, uint64_t nbytes, std::string* why) {
  // Grown as bytes arrive: a header that claims a huge length and sends
  // little costs what was sent, not what was claimed.
  constexpr uint64_t kStep = uint64_t{64} << 20;
  try {
    Payload buf = std::make_shared<HeapBlock>(std::min(nbytes, kStep));
    uint64_t got = 0;
    for (;;) {
      IoStatus st = RecvAll(c->fd, buf->data() + got, buf->size() - got, stall_ms, stall_ms);
      if (st != IoStatus::kOk) {
        *why = std::string("truncated push: ") + IoStatusName(st);
        return nullptr;
      }
      got = buf->size();
      if (got == nbytes) return buf;
      Payload bigger = std::make_shared<HeapBlock>(std::min(nbytes, 2 * got));
      std::memcpy(bigger->data(), buf->data(), got);
      buf = std::move(bigger);
    }
  } catch (const std::bad_alloc&) {
    *why = "out of memory receiving a push of " + std::to_string(nbytes) + " bytes";
    return nullptr;
  }
}

void SummationServer::Impl::ReaderLoop(ConnPtr c) {
  NameThisThread("jbps-read");
  bool said_bye_here = false;
  uint64_t purge_before = 0;  // a finished job's sums still held for readers that left
  std::string lost;  // why the worker is gone, if it did not say goodbye
  for (;;) {
    FrameHeader h;
    IoStatus st = RecvAll(c->fd, &h, sizeof(h), -1, stall_ms);
    const int64_t read_ns = (h.flags & kFlagTimed) ? SteadyNs() : 0;
    if (st != IoStatus::kOk) {
      lost = st == IoStatus::kClosed ? "was lost: its connection closed without a goodbye (killed or crashed?)"
                                     : std::string("was lost: its connection failed: ") + IoStatusName(st);
      break;
    }
    std::string why = ValidateHeader(h, opt.token);
    if (why.empty() && h.type == static_cast<uint16_t>(MsgType::kBye)) {
      std::string reason(h.nbytes, '\0');
      if (h.nbytes > 0 && RecvAll(c->fd, reason.data(), reason.size(), stall_ms, stall_ms) != IoStatus::kOk)
        reason = "(its reason did not arrive)";
      said_bye_here = reason.empty();
      lost = "left the job: " + reason;  // a goodbye with a reason: it failed, and the others must hear why
      break;
    }
    const bool tree = h.type == static_cast<uint16_t>(MsgType::kTree);
    const bool shm_push = h.type == static_cast<uint16_t>(MsgType::kPushShm);
    const bool release = h.type == static_cast<uint16_t>(MsgType::kRelease);
    if (why.empty() && h.type != static_cast<uint16_t>(MsgType::kPush) && !tree && !shm_push && !release)
      why = "unexpected message type";
    if (why.empty() && h.sender != c->rank) why = "push claims another worker's rank";
    if (why.empty() && release) {
      Release(c, h);
      continue;
    }
    if (why.empty() && tree) {
      if (ReadTreeCheck(c, h, &why)) continue;
    }
    Payload data;
    if (why.empty() && shm_push) {
      ShmRef ref;
      IoStatus rst = RecvAll(c->fd, &ref, sizeof(ref), stall_ms, stall_ms);
      std::shared_ptr<SharedRegion> region = c->shm.load(std::memory_order_acquire) ? c->push_region : nullptr;
      if (rst != IoStatus::kOk) {
        why = std::string("truncated push: ") + IoStatusName(rst);
      } else if (!region) {
        why = "a shared-memory push without a shared region";
      } else if (!region->Contains(ref.offset, ref.nbytes) || ref.nbytes > opt.max_payload_bytes ||
                 ref.nbytes % DTypeSize(static_cast<DType>(h.dtype)) != 0) {
        why = "a shared-memory push outside its region or not whole elements";
      } else {
        data = std::make_shared<PushView>(region, ref.offset, ref.nbytes);
      }
    } else if (why.empty()) {
      if (h.nbytes > opt.max_payload_bytes)
        why = "push of " + std::to_string(h.nbytes) + " bytes, over this server's limit of " +
              std::to_string(opt.max_payload_bytes);
      else
        data = RecvPayload(c, h.nbytes, &why);
    }
    if (!why.empty()) {
      Refuse(c->peer, "worker " + std::to_string(c->rank) + ": " + why);
      lost = "was lost: it sent a bad message: " + why;
      break;
    }
    const uint64_t nbytes = data->size();
    ++pushes;
    bytes_received += nbytes;
    if (shm_push) bytes_shm += nbytes;
    // A TCP push is acknowledged now: its bytes are here. A shared-memory
    // one once added (Process): until then the worker must not reuse its slot.
    if (!shm_push) Ack(c, h.key, h.round);
    EngineThread* e = ThreadFor(h.key, nbytes);
    if (e == nullptr) {  // the error acknowledges the push too
      SendError(c, h.key, h.round, "the server already tracks " + std::to_string(opt.max_keys) +
                                       " keys, its limit (are tensor names unique per step?)");
      continue;
    }
    Task t{h.key, h.round, static_cast<DType>(h.dtype), c->rank, std::move(data), c, h.aux, shm_push};
    if (h.flags & kFlagTimed) t.read_ns = read_ns;
    {
      // Nothing queued: add it here, sparing the summing thread's wake-up,
      // when nobody is summing or another reader is adding a small push.
      std::unique_lock<std::mutex> lock(e->mu);
      bool here = false;
      if (nbytes <= kInlineSumBytes && e->queue.empty()) {
        here = e->run_mu.try_lock();
        if (!here && e->reader_running) {
          lock.unlock();
          e->run_mu.lock();
          here = true;
        }
      }
      if (here) {
        if (lock.owns_lock()) lock.unlock();
        e->reader_running = true;
        RunTask(e, t);
        e->reader_running = false;
        e->run_mu.unlock();
        continue;
      }
      e->queue.push_back(std::move(t));
    }
    e->cv.notify_one();
  }
  if (!said_bye_here && !stopping && !c->aborted) WorkerLost(c, lost);
  c->Close();
  if (c->shm.exchange(false)) --shm_workers;
  {
    // Unmapped now, not when the connection is reaped: pushes still queued
    // hold their own reference until they are added.
    std::lock_guard<std::mutex> lock(c->mu);
    c->push_region.reset();
  }
  c->reader_done = true;
  bool job_over = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (c->epoch >= epoch) connected[c->rank] = false;
    if (said_bye_here && c->epoch == epoch && !said_bye[c->rank]) {
      said_bye[c->rank] = true;
      if (++byes == opt.num_workers) {
        if (opt.keep_alive) {
          ++epoch;  // a new job may start with the same ranks and fresh rounds
          purge_before = epoch;
          byes = 0;
          said_bye.assign(opt.num_workers, false);
        } else {
          job_over = true;
        }
      }
    }
  }
  if (purge_before > 0) DropEndedJobs(purge_before);
  if (job_over) MarkFinished();
}

// A worker is gone without a goodbye, or said one with a reason (it failed):
// no round it was part of can finish, so every other worker is told (naming
// it) and disconnected. A keep-alive server then waits for a new job;
// otherwise the job is over. `what` follows "worker N (peer) ".
void SummationServer::Impl::WorkerLost(const ConnPtr& c, const std::string& what) {
  const std::string msg = "jbps: worker " + std::to_string(c->rank) + " (" + c->peer + ") " + what +
                          "; seen by summation server " + Name();
  ++workers_lost;
  LogWarning("%s", msg.c_str());
  std::vector<ConnPtr> others;
  uint64_t new_epoch = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (c->epoch != epoch) return;  // that job already failed
    if (failure.empty()) failure = msg;
    for (auto& o : conns)
      if (o != c && o->epoch == epoch) others.push_back(o);
    if (opt.keep_alive) {
      ++epoch;
      byes = 0;
      said_bye.assign(opt.num_workers, false);
      connected.assign(opt.num_workers, false);
    }
    new_epoch = epoch;
  }
  if (opt.keep_alive) DropEndedJobs(new_epoch);
  FrameHeader h = MakeHeader(MsgType::kAbort, opt.token);
  h.nbytes = std::min<uint64_t>(msg.size(), kMaxErrorBytes);
  for (auto& o : others) o->Finish(OutMsg{h, nullptr, msg.substr(0, h.nbytes)});
  if (opt.keep_alive) return;
  // Give the writers a moment to deliver the news before the process may exit.
  auto deadline = Clock::now() + std::chrono::seconds(1);
  for (auto& o : others)
    while (!o->writer_done && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  MarkFinished();
}

// Sends what is queued in one syscall: acknowledgements first, since a
// worker's credit window waits on them while sums only fill its output.
void SummationServer::Impl::WriterLoop(ConnPtr c) {
  NameThisThread("jbps-write");
  std::vector<OutMsg> batch;
  std::vector<struct iovec> iov;
  for (;;) {
    bool last;
    {
      std::unique_lock<std::mutex> lock(c->mu);
      c->cv.wait(lock, [&] { return c->closing || !c->out.empty(); });
      if (c->closing) break;
      batch.clear();
      while (!c->out.empty() && batch.size() < kMaxWriteBatch) {
        batch.push_back(std::move(c->out.front()));
        c->out.pop_front();
      }
      last = c->finishing && c->out.empty();
    }
    std::stable_partition(batch.begin(), batch.end(), [](const OutMsg& m) {
      return m.header.type == static_cast<uint16_t>(MsgType::kPushAck);
    });
    iov.clear();
    for (OutMsg& m : batch) {
      StampTimedSum(m);
      iov.push_back({&m.header, sizeof(m.header)});
      if (m.payload && m.header.nbytes > 0) {
        iov.push_back({m.payload->data(), m.header.nbytes});
      } else if (!m.text.empty()) {
        iov.push_back({const_cast<char*>(m.text.data()), m.text.size()});
      }
    }
    IoStatus st;
    {
      std::lock_guard<std::mutex> writing(c->write_mu);
      st = SendAll(c->fd, iov.data(), static_cast<int>(iov.size()), stall_ms);
    }
    if (st != IoStatus::kOk || last) {
      c->Close();
      break;
    }
  }
  c->writer_done = true;
}

void SummationServer::Impl::SendError(const ConnPtr& c, uint64_t key, uint32_t round, const std::string& msg,
                                      uint8_t flags) {
  OutMsg m{MakeHeader(MsgType::kError, opt.token), nullptr, msg.substr(0, kMaxErrorBytes)};
  m.header.key = key;
  m.header.round = round;
  m.header.flags = flags;
  m.header.nbytes = m.text.size();
  Deliver(c, std::move(m));
}

// Sends m now on this thread when the connection's writer is idle (nothing
// queued, nothing being written) and m is small; queues it for the writer
// otherwise. Small messages on an idle socket fit its buffer at once, and
// every answer a worker waits for (an acknowledgement, a sum in shared
// memory, a small sum) then costs no thread hand-off.
void SummationServer::Impl::Deliver(const ConnPtr& c, OutMsg m) {
  const uint64_t bytes = m.payload ? m.header.nbytes : m.text.size();
  if (bytes <= kDirectWriteBytes) {
    std::unique_lock<std::mutex> writing(c->write_mu, std::try_to_lock);
    if (writing.owns_lock()) {
      bool idle;
      {
        std::lock_guard<std::mutex> lock(c->mu);
        idle = c->out.empty() && !c->closing && !c->finishing;
      }
      if (idle) {
        StampTimedSum(m);
        struct iovec iov[2] = {{&m.header, sizeof(m.header)}, {nullptr, 0}};
        int n = 1;
        if (m.payload && m.header.nbytes > 0) {
          iov[n++] = {m.payload->data(), m.header.nbytes};
        } else if (!m.text.empty()) {
          iov[n++] = {const_cast<char*>(m.text.data()), m.text.size()};
        }
        if (SendAll(c->fd, iov, n, stall_ms) != IoStatus::kOk) c->Close();
        return;
      }
    }
  }
  c->Send(std::move(m));
}

EngineThread* SummationServer::Impl::ThreadFor(uint64_t key, uint64_t nbytes) {
  // A key's rounds all run on one thread; a new key goes to the thread with
  // the fewest bytes bound so far. One entry per key the workers' plans name.
  std::lock_guard<std::mutex> lock(bind_mu);
  auto it = key_thread.find(key);
  if (it == key_thread.end()) {
    if (key_thread.size() >= opt.max_keys) return nullptr;
    size_t best = std::min_element(thread_bytes.begin(), thread_bytes.end()) - thread_bytes.begin();
    thread_bytes[best] += nbytes;
    it = key_thread.emplace(key, best).first;
  }
  return engines[it->second].get();
}

void SummationServer::Impl::EngineLoop(EngineThread* e) {
  NameThisThread("jbps-sum");
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(e->mu);
      e->cv.wait(lock, [&] { return e->stop || !e->queue.empty() || e->next_epoch > e->epoch; });
      if (e->stop) return;
    }
    std::lock_guard<std::mutex> running(e->run_mu);
    Task t;
    bool have = false;
    {
      std::lock_guard<std::mutex> lock(e->mu);
      if (!e->queue.empty()) {  // readers add their own pushes only when it is empty
        t = std::move(e->queue.front());
        e->queue.pop_front();
        have = true;
      }
    }
    (void)have;
    RunTask(e, t);  // without a push (t.conn null) when only a job ended
  }
}

// With e->run_mu held: drops the rounds of jobs that ended, then adds t's
// push (if any) to its round.
void SummationServer::Impl::RunTask(EngineThread* e, Task& t) {
  uint64_t ended;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    ended = e->next_epoch;
  }
  if (ended > e->epoch) {
    e->rounds.clear();
    e->onebit_residuals.clear();
    e->epoch = ended;
  }
  if (!t.conn) return;
  // A failed or finished job's half-done rounds are dropped, not mixed into the next job.
  if (t.conn->epoch >= e->epoch) {
    if (t.conn->epoch > e->epoch) {
      e->rounds.clear();
      e->onebit_residuals.clear();
      e->epoch = t.conn->epoch;
    }
    Process(t, e);
  }
  // A shared-memory push is acknowledged once taken into its round (its
  // slot stays the server's until the round's sum or error goes out).
  if (t.ack_after) Ack(t.conn, t.key, t.round);
}

// Adds the held pushes that can be added. The first two are summed in one
// pass (AccumulatorInitSum) into a new block, so a push is never copied
// before it is added; a lone first push waits for a partner. Rank order when
// deterministic ((a + b) + c, whatever the arrival order), else arrival order.
void SummationServer::Impl::Fold(RoundState& st, DType dtype) {
  const size_t count = st.nbytes / DTypeSize(dtype);
  auto ready = [&]() -> size_t {
    if (!opt.deterministic) return st.held.size();
    size_t n = 0;
    while (st.folded + n < st.held.size() && st.held[st.folded + n]) ++n;
    return n;
  };
  auto take = [&]() -> Payload {
    Payload p;
    if (opt.deterministic) {
      p = std::move(st.held[st.folded]);
    } else {
      p = std::move(st.held.front());
      st.held.erase(st.held.begin());
    }
    ++st.folded;
    return p;
  };
  for (;;) {
    const size_t n = ready();
    if (st.acc) {
      if (n == 0) return;
      Payload p = take();
      AccumulatorAdd(dtype, st.acc->data(), p->data(), count);
    } else if (opt.num_workers == 1) {
      if (n == 0) return;
      Payload p = take();
      st.acc = NewBlock(count * AccumulatorSize(dtype));
      AccumulatorInit(dtype, st.acc->data(), p->data(), count);
    } else {
      if (n < 2) return;
      Payload a = take();
      Payload b = take();
      st.acc = NewBlock(count * AccumulatorSize(dtype));
      AccumulatorInitSum(dtype, st.acc->data(), a->data(), b->data(), count);
    }
  }
}

void SummationServer::Impl::Process(Task& t, EngineThread* e) {
  const RoundKey rk{t.key, t.round};
  RoundState& st = e->rounds[rk];
  const uint64_t nbytes = t.data->size();
  if (st.pushed.empty()) {
    st.pushed.assign(opt.num_workers, false);
    st.dtype = t.dtype;
    st.nbytes = nbytes;
    st.first_rank = t.rank;
    st.digest = t.digest;
  }
  if (st.pushed[t.rank]) {
    // A second push of the same round from one worker is a protocol error;
    // answer it alone and leave the round to the others.
    SendError(t.conn, t.key, t.round, "duplicate push of key round " + std::to_string(t.round) + " from worker " +
                                          std::to_string(t.rank));
    return;
  }
  st.pushed[t.rank] = true;
  ++st.pushes;
  st.waiters.push_back(t.conn);
  st.read_ns.push_back(t.read_ns);
  st.last_read_ns = std::max(st.last_read_ns, t.read_ns);

  // Pushes of calls whose trees differ are never summed: the round fails
  // for every worker, flagged, and the tree check names the difference.
  if (st.error.empty() && t.digest != st.digest) {
    st.error = "workers disagree on the tree of this psum: worker " + std::to_string(st.first_rank) + " and worker " +
               std::to_string(t.rank) + " called it with different trees (round " + std::to_string(t.round) + ")";
  } else if (st.error.empty() && (t.dtype != st.dtype || nbytes != st.nbytes)) {
    st.error = "workers disagree on this tensor: worker " + std::to_string(st.first_rank) + " pushed " +
               std::to_string(st.nbytes / DTypeSize(st.dtype)) + " elements of " + DTypeName(st.dtype) +
               ", worker " + std::to_string(t.rank) + " pushed " + std::to_string(nbytes / DTypeSize(t.dtype)) +
               " elements of " + DTypeName(t.dtype) + " (round " + std::to_string(t.round) + ")";
  } else if (!st.error.empty()) {
    SendError(t.conn, t.key, t.round, st.error, st.error_flags);
  }
  if (!st.error.empty() && st.error_flags == 0) {  // found just now
    st.error_flags = kFlagTreeMismatch;
    st.acc.reset();
    st.held.clear();
    for (auto& w : st.waiters) SendError(w, t.key, t.round, st.error, st.error_flags);
  } else if (st.error.empty()) {
    if (!opt.deterministic) {
      st.held.push_back(std::move(t.data));
    } else {
      if (st.held.empty()) st.held.resize(opt.num_workers);
      st.held[t.rank] = std::move(t.data);
    }
    Fold(st, t.dtype);
  }

  // Taken: acknowledged, unless the round's sum or error goes to this worker
  // now, which acknowledges the push as well.
  if (t.ack_after) {
    if (st.pushes < opt.num_workers && st.error.empty()) Ack(t.conn, t.key, t.round);
    t.ack_after = false;
  }
  if (st.pushes < opt.num_workers) return;
  // Every worker pushed, so in deterministic mode every push is folded too.
  if (st.error.empty()) {
    Payload result = st.acc;
    if (st.dtype == DType::kOneBit) {
      size_t records = st.nbytes / kOneBitRecordBytes;
      std::vector<float>& residual = e->onebit_residuals[t.key];
      if (residual.size() != records * kOneBitBlock) residual.assign(records * kOneBitBlock, 0.0f);
      result = NewBlock(st.nbytes);
      OneBitEncodeWithFeedback(reinterpret_cast<uint8_t*>(result->data()), reinterpret_cast<float*>(st.acc->data()), residual.data(), records);
    } else if (!AccumulatorIsWire(st.dtype)) {
      size_t count = st.nbytes / DTypeSize(st.dtype);
      result = NewBlock(st.nbytes);
      AccumulatorFinish(st.dtype, result->data(), st.acc->data(), count);
    }
    int readers = 0;
    for (auto& w : st.waiters) readers += w->shm.load(std::memory_order_acquire);
    if (readers > 0) result = InArena(std::move(result));
    const bool shared = readers > 0 && result->arena_offset() >= 0;
    if (shared) {  // held until every shared-memory worker has copied it out (kRelease)
      std::lock_guard<std::mutex> lock(holds_mu);
      holds[JobRoundKey{t.conn->epoch, t.key, t.round}] = Hold{result, readers};
    }
    FrameHeader h = MakeHeader(MsgType::kSum, opt.token);
    h.key = t.key;
    h.round = t.round;
    h.dtype = static_cast<uint8_t>(st.dtype);
    h.nbytes = st.nbytes;
    FrameHeader hs = h;
    hs.type = static_cast<uint16_t>(MsgType::kSumShm);
    hs.nbytes = sizeof(ShmRef);
    ShmRef ref;
    ref.offset = shared ? static_cast<uint64_t>(result->arena_offset()) : 0;
    ref.nbytes = st.nbytes;
    const std::string ref_bytes(reinterpret_cast<const char*>(&ref), sizeof(ref));
    for (size_t i = 0; i < st.waiters.size(); ++i) {
      auto& w = st.waiters[i];
      OutMsg m;
      if (shared && w->shm.load(std::memory_order_acquire)) {
        m = OutMsg{hs, nullptr, ref_bytes};
        bytes_shm += st.nbytes;
      } else {
        m = OutMsg{h, result, {}};
      }
      if (st.read_ns[i] != 0) {
        m.last_read_ns = st.last_read_ns;
        m.own_read_ns = st.read_ns[i];
      }
      Deliver(w, std::move(m));
      ++sums_sent;
    }
  }
  e->rounds.erase(rk);
}

}  // namespace jbps
