// Admission: the acceptor reads every new connection's hello, checks the
// job's token and the worker's rank, and only then gives it threads; on the
// shared-memory socket it takes a colocated worker's push region.
#include "server/server_impl.h"

namespace jbps {

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
    const auto now = Clock::now();
    if (now >= join_deadline) CheckJoined();
    // Hellos first (their fds are in `fds` in list order), then new connections.
    size_t i = 3;
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

// The join deadline has passed: every worker must have connected by now, or
// the job fails naming who never did (the acceptor wakes at least once a second).
void SummationServer::Impl::CheckJoined() {
  join_deadline = Clock::time_point::max();
  std::string absent, msg;
  std::vector<ConnPtr> others;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (int r = 0; r < opt.num_workers; ++r)
      if (!joined[r]) absent += (absent.empty() ? "" : ", ") + std::to_string(r);
    if (absent.empty() || finished) return;
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%g", opt.join_timeout_s);
    msg = "jbps: worker rank(s) " + absent + " never connected to summation server " + Name() + " within " + seconds +
          " s (JBPS_TIMEOUT_S): did they fail to start?";
    if (failure.empty()) failure = msg;
    others.assign(conns.begin(), conns.end());
  }
  LogWarning("%s", msg.c_str());
  FailJob(std::move(others), msg);
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
    why =
        "worker rank " + std::to_string(h.sender) + " out of range for " + std::to_string(opt.num_workers) + " workers";
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
      joined[h.sender] = true;
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
  // The instance names where shared memory is offered (shm.h); 0 when there is none.
  FrameHeader ok = HelloOkFrame(opt.token, opt.role, arena ? instance : 0);
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

}  // namespace jbps
