// The summation server's orchestration: start (listen, engine threads,
// shared memory, the acceptor), stop, stats (server_impl.h says which file
// holds the rest).
#include "server/server_impl.h"

namespace jbps {

SummationServer::SummationServer(ServerOptions options) : impl_(new Impl) { impl_->opt = std::move(options); }

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
  s.joined.assign(s.opt.num_workers, false);
  if (s.opt.join_timeout_s > 0 && !s.opt.keep_alive)
    s.join_deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s.opt.join_timeout_s));
  s.said_bye.assign(s.opt.num_workers, false);
  int n = s.opt.sum_threads;
  if (n <= 0) n = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
  for (int i = 0; i < n; ++i) {
    s.sum_threads.emplace_back(new SumThread);
    SumThread* e = s.sum_threads.back().get();
    e->thread = std::thread([&s, e] { s.SumLoop(e); });
  }
  s.thread_bytes.assign(s.sum_threads.size(), 0);
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
  return impl_->finished_cv.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return impl_->finished; });
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
  for (auto& e : s.sum_threads) {
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

}  // namespace jbps
