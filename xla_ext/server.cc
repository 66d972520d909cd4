#include "server.h"

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "aligned_buffer.h"
#include "log.h"
#include "net.h"
#include "protocol.h"
#include "sum_kernels.h"

namespace jbps {
namespace {

using Payload = std::shared_ptr<AlignedBuffer>;

struct OutMsg {
  FrameHeader header;
  Payload payload;   // shared by every worker receiving the same sum
  std::string text;  // error messages
};

// One worker's connection. The reader owns the receive side; the writer
// drains `out` so engine threads never block on a slow socket.
struct Conn {
  int fd = -1;
  std::string peer;
  uint32_t rank = UINT32_MAX;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<OutMsg> out;
  bool closing = false;
  std::atomic<bool> reader_done{false};
  std::atomic<bool> writer_done{false};
  std::thread reader;
  std::thread writer;

  void Send(OutMsg msg) {
    std::lock_guard<std::mutex> lock(mu);
    if (closing) return;
    out.push_back(std::move(msg));
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
  std::vector<Payload> held;  // deterministic mode: pushes waiting for a lower rank
  std::vector<ConnPtr> waiters;
  std::string error;
};

struct EngineThread {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> queue;
  bool stop = false;
  std::thread thread;
  // Owned by `thread` alone: no lock needed.
  std::unordered_map<RoundKey, RoundState, RoundKeyHash> rounds;
};

}  // namespace

struct SummationServer::Impl {
  ServerOptions opt;
  int listen_fd = -1;
  int port = 0;
  int stall_ms = 60000;
  std::thread acceptor;
  std::vector<std::unique_ptr<EngineThread>> engines;

  std::mutex bind_mu;  // guards key_thread, thread_bytes
  std::unordered_map<uint64_t, size_t> key_thread;
  std::vector<uint64_t> thread_bytes;

  std::mutex mu;  // guards conns, connected, byes, finished
  std::condition_variable finished_cv;
  std::list<ConnPtr> conns;
  std::vector<bool> connected;
  std::vector<bool> said_bye;
  int byes = 0;
  bool finished = false;
  std::atomic<bool> stopping{false};

  std::atomic<uint64_t> pushes{0}, bytes_received{0}, sums_sent{0}, rejected{0};

  void AcceptLoop();
  void ReaderLoop(ConnPtr c);
  void WriterLoop(ConnPtr c);
  void EngineLoop(EngineThread* e);
  bool Handshake(const ConnPtr& c);
  void Reject(const ConnPtr& c, const std::string& why);
  void Process(Task& t, EngineThread* e);
  void Fold(RoundState& st, DType dtype, Payload data);
  EngineThread* ThreadFor(uint64_t key, uint64_t nbytes);
  void SendError(const ConnPtr& c, uint64_t key, uint32_t round, const std::string& msg);
  void ReapFinishedConns();
  void MarkFinished();
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
  s.stall_ms = static_cast<int>(s.opt.timeout_s * 1000);
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
  s.acceptor = std::thread([&s] { s.AcceptLoop(); });
  return true;
}

int SummationServer::port() const { return impl_->port; }

bool SummationServer::WaitFor(double seconds) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  return impl_->finished_cv.wait_for(lock, std::chrono::duration<double>(seconds),
                                     [this] { return impl_->finished; });
}

void SummationServer::Stop() {
  Impl& s = *impl_;
  if (s.stopping.exchange(true)) return;
  ShutdownFd(s.listen_fd);
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
  s.MarkFinished();
}

ServerStats SummationServer::stats() const {
  ServerStats st;
  st.pushes = impl_->pushes.load();
  st.bytes_received = impl_->bytes_received.load();
  st.sums_sent = impl_->sums_sent.load();
  st.rejected = impl_->rejected.load();
  std::lock_guard<std::mutex> lock(impl_->bind_mu);
  st.thread_bytes = impl_->thread_bytes;
  return st;
}

void SummationServer::Impl::MarkFinished() {
  std::lock_guard<std::mutex> lock(mu);
  finished = true;
  finished_cv.notify_all();
}

void SummationServer::Impl::AcceptLoop() {
  for (;;) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (stopping) return;
      if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: back off instead of spinning.
        if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      return;
    }
    TuneSocket(fd);
    auto c = std::make_shared<Conn>();
    c->fd = fd;
    c->peer = PeerName(fd);
    ReapFinishedConns();
    std::lock_guard<std::mutex> lock(mu);
    if (stopping) {
      CloseFd(fd);
      return;
    }
    conns.push_back(c);
    c->reader = std::thread([this, c] { ReaderLoop(c); });
    c->writer = std::thread([this, c] { WriterLoop(c); });
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

void SummationServer::Impl::Reject(const ConnPtr& c, const std::string& why) {
  ++rejected;
  LogWarning("jbps.server: refused connection from %s: %s", c->peer.c_str(), why.c_str());
}

bool SummationServer::Impl::Handshake(const ConnPtr& c) {
  FrameHeader h;
  IoStatus st = RecvAll(c->fd, &h, sizeof(h), stall_ms, stall_ms);
  if (st != IoStatus::kOk) {
    Reject(c, std::string("no hello: ") + IoStatusName(st));
    return false;
  }
  std::string why = ValidateHeader(h, opt.token);
  if (why.empty() && h.type != static_cast<uint16_t>(MsgType::kHello)) why = "first message is not a hello";
  if (!why.empty()) {
    Reject(c, why);
    return false;
  }
  // From here on the peer has the job token, so it gets told why it is refused.
  if (h.key != static_cast<uint64_t>(opt.num_workers)) {
    why = "worker expects " + std::to_string(h.key) + " workers, this server was started with --num-workers " +
          std::to_string(opt.num_workers);
  } else if (h.sender >= static_cast<uint32_t>(opt.num_workers)) {
    why = "worker rank " + std::to_string(h.sender) + " out of range for " + std::to_string(opt.num_workers) +
          " workers";
  } else {
    std::lock_guard<std::mutex> lock(mu);
    if (connected[h.sender]) {
      why = "worker rank " + std::to_string(h.sender) + " is already connected";
    } else {
      connected[h.sender] = true;
      c->rank = h.sender;
    }
  }
  if (!why.empty()) {
    Reject(c, why);
    // Written here, not queued: the connection closes right after, and the
    // writer has nothing else to send yet.
    FrameHeader eh = MakeHeader(MsgType::kError, opt.token);
    eh.nbytes = why.size();
    struct iovec iov[2] = {{&eh, sizeof(eh)}, {const_cast<char*>(why.data()), why.size()}};
    SendAll(c->fd, iov, 2, stall_ms);
    return false;
  }
  FrameHeader ok = MakeHeader(MsgType::kHelloOk, opt.token);
  ok.key = static_cast<uint64_t>(opt.role);
  c->Send(OutMsg{ok, nullptr, {}});
  return true;
}

void SummationServer::Impl::ReaderLoop(ConnPtr c) {
  bool said_bye_here = false;
  if (Handshake(c)) {
    for (;;) {
      FrameHeader h;
      IoStatus st = RecvAll(c->fd, &h, sizeof(h), -1, stall_ms);
      if (st != IoStatus::kOk) {
        if (!stopping && st != IoStatus::kClosed)
          LogWarning("jbps.server: worker %u (%s): %s", c->rank, c->peer.c_str(), IoStatusName(st));
        break;
      }
      std::string why = ValidateHeader(h, opt.token);
      if (why.empty() && h.type == static_cast<uint16_t>(MsgType::kBye)) {
        said_bye_here = true;
        break;
      }
      if (why.empty() && h.type != static_cast<uint16_t>(MsgType::kPush)) why = "unexpected message type";
      if (why.empty() && h.sender != c->rank) why = "push claims another worker's rank";
      if (!why.empty()) {
        Reject(c, why);
        break;
      }
      Payload data = std::make_shared<AlignedBuffer>(h.nbytes);
      st = RecvAll(c->fd, data->data(), h.nbytes, stall_ms, stall_ms);
      if (st != IoStatus::kOk) {
        LogWarning("jbps.server: worker %u (%s): truncated push: %s", c->rank, c->peer.c_str(), IoStatusName(st));
        break;
      }
      ++pushes;
      bytes_received += h.nbytes;
      FrameHeader ack = MakeHeader(MsgType::kPushAck, opt.token);
      ack.key = h.key;
      ack.round = h.round;
      c->Send(OutMsg{ack, nullptr, {}});
      EngineThread* e = ThreadFor(h.key, h.nbytes);
      {
        std::lock_guard<std::mutex> lock(e->mu);
        e->queue.push_back(Task{h.key, h.round, static_cast<DType>(h.dtype), c->rank, std::move(data), c});
      }
      e->cv.notify_one();
    }
  }
  c->Close();
  c->reader_done = true;
  if (c->rank != UINT32_MAX) {
    bool job_over = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      connected[c->rank] = false;
      if (said_bye_here && !said_bye[c->rank]) {
        said_bye[c->rank] = true;
        job_over = ++byes == opt.num_workers && !opt.keep_alive;
      }
      if (said_bye_here && opt.keep_alive && byes == opt.num_workers) {
        byes = 0;  // a new job may start with the same ranks
        said_bye.assign(opt.num_workers, false);
      }
    }
    if (job_over) MarkFinished();
  }
}

void SummationServer::Impl::WriterLoop(ConnPtr c) {
  for (;;) {
    OutMsg m;
    {
      std::unique_lock<std::mutex> lock(c->mu);
      c->cv.wait(lock, [&] { return c->closing || !c->out.empty(); });
      if (c->closing) break;
      m = std::move(c->out.front());
      c->out.pop_front();
    }
    struct iovec iov[2];
    int n = 1;
    iov[0] = {&m.header, sizeof(m.header)};
    if (m.payload && m.header.nbytes > 0) {
      iov[n++] = {m.payload->data(), m.header.nbytes};
    } else if (!m.text.empty()) {
      iov[n++] = {const_cast<char*>(m.text.data()), m.text.size()};
    }
    if (SendAll(c->fd, iov, n, stall_ms) != IoStatus::kOk) {
      c->Close();
      break;
    }
  }
  c->writer_done = true;
}

void SummationServer::Impl::SendError(const ConnPtr& c, uint64_t key, uint32_t round, const std::string& msg) {
  OutMsg m{MakeHeader(MsgType::kError, opt.token), nullptr, msg.substr(0, kMaxErrorBytes)};
  m.header.key = key;
  m.header.round = round;
  m.header.nbytes = m.text.size();
  c->Send(std::move(m));
}

EngineThread* SummationServer::Impl::ThreadFor(uint64_t key, uint64_t nbytes) {
  // A key's rounds all run on one thread; a new key goes to the thread with
  // the fewest bytes bound so far. One entry per key the workers' plans name.
  std::lock_guard<std::mutex> lock(bind_mu);
  auto it = key_thread.find(key);
  if (it == key_thread.end()) {
    size_t best = std::min_element(thread_bytes.begin(), thread_bytes.end()) - thread_bytes.begin();
    thread_bytes[best] += nbytes;
    it = key_thread.emplace(key, best).first;
  }
  return engines[it->second].get();
}

void SummationServer::Impl::EngineLoop(EngineThread* e) {
  for (;;) {
    Task t;
    {
      std::unique_lock<std::mutex> lock(e->mu);
      e->cv.wait(lock, [&] { return e->stop || !e->queue.empty(); });
      if (e->stop) return;
      t = std::move(e->queue.front());
      e->queue.pop_front();
    }
    Process(t, e);
  }
}

void SummationServer::Impl::Fold(RoundState& st, DType dtype, Payload data) {
  const size_t count = data->size() / DTypeSize(dtype);
  if (st.folded++ == 0) {
    if (AccumulatorIsWire(dtype)) {
      st.acc = std::move(data);  // the first push becomes the sum: no copy
    } else {
      st.acc = std::make_shared<AlignedBuffer>(count * AccumulatorSize(dtype));
      AccumulatorInit(dtype, st.acc->data(), data->data(), count);
    }
  } else {
    AccumulatorAdd(dtype, st.acc->data(), data->data(), count);
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

  if (st.error.empty() && (t.dtype != st.dtype || nbytes != st.nbytes)) {
    st.error = "workers disagree on this tensor: worker " + std::to_string(st.first_rank) + " pushed " +
               std::to_string(st.nbytes / DTypeSize(st.dtype)) + " elements of " + DTypeName(st.dtype) +
               ", worker " + std::to_string(t.rank) + " pushed " + std::to_string(nbytes / DTypeSize(t.dtype)) +
               " elements of " + DTypeName(t.dtype) + " (round " + std::to_string(t.round) + ")";
    st.acc.reset();
    st.held.clear();
    for (auto& w : st.waiters) SendError(w, t.key, t.round, st.error);
  } else if (!st.error.empty()) {
    SendError(t.conn, t.key, t.round, st.error);
  } else if (!opt.deterministic) {
    Fold(st, t.dtype, std::move(t.data));  // in arrival order
  } else {
    // In rank order: hold a push until every lower rank's push is added.
    if (st.held.empty()) st.held.resize(opt.num_workers);
    st.held[t.rank] = std::move(t.data);
    while (st.folded < opt.num_workers && st.held[st.folded]) {
      Payload next = std::move(st.held[st.folded]);
      Fold(st, t.dtype, std::move(next));
    }
  }

  if (st.pushes < opt.num_workers) return;
  // Every worker pushed, so in deterministic mode every push is folded too.
  if (st.error.empty()) {
    Payload result = st.acc;
    if (!AccumulatorIsWire(st.dtype)) {
      size_t count = st.nbytes / DTypeSize(st.dtype);
      result = std::make_shared<AlignedBuffer>(st.nbytes);
      AccumulatorFinish(st.dtype, result->data(), st.acc->data(), count);
    }
    FrameHeader h = MakeHeader(MsgType::kSum, opt.token);
    h.key = t.key;
    h.round = t.round;
    h.dtype = static_cast<uint8_t>(st.dtype);
    h.nbytes = st.nbytes;
    for (auto& w : st.waiters) {
      w->Send(OutMsg{h, result, {}});
      ++sums_sent;
    }
  }
  e->rounds.erase(rk);
}

}  // namespace jbps
