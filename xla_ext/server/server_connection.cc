// A worker's connection: the reader decodes its frames (pushes, tree checks,
// releases, goodbyes), the writer sends what engine threads queued; a worker
// gone without a goodbye ends the job for the others.
#include "server/server_impl.h"

namespace jbps {

void SummationServer::Impl::Ack(const ConnPtr& c, uint64_t key, uint32_t round) {
  FrameHeader ack = RoundFrame(MsgType::kPushAck, opt.token, key, round);
  Deliver(c, OutMsg{ack, nullptr, {}});  // on the worker's credit loop
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

Payload SummationServer::Impl::RecvPayload(FrameReader* reader, uint64_t nbytes, std::string* why) {
  // Grown as bytes arrive: a header that claims a huge length and sends
  // little costs what was sent, not what was claimed.
  constexpr uint64_t kStep = uint64_t{64} << 20;
  try {
    Payload buf = HeapBlockOf(std::min(nbytes, kStep));
    uint64_t got = 0;
    for (;;) {
      IoStatus st = reader->Read(buf->data() + got, buf->size() - got);
      if (st != IoStatus::kOk) {
        *why = std::string("truncated push: ") + IoStatusName(st);
        return nullptr;
      }
      got = buf->size();
      if (got == nbytes) return buf;
      Payload bigger = HeapBlockOf(std::min(nbytes, 2 * got));
      std::memcpy(bigger->data(), buf->data(), got);
      buf = std::move(bigger);
    }
  } catch (const std::bad_alloc&) {
    *why = "out of memory receiving a push of " + std::to_string(nbytes) + " bytes";
    return nullptr;
  }
}

// A shared-memory push: where it lies in the worker's region, read in place.
Payload SummationServer::Impl::ShmPush(const ConnPtr& c, const Frame& f, std::string* why) {
  std::shared_ptr<SharedRegion> region = c->shm.load(std::memory_order_acquire) ? c->push_region : nullptr;
  if (!region) {
    *why = "a shared-memory push without a shared region";
  } else if (!region->Contains(f.shm.offset, f.shm.nbytes) || f.shm.nbytes > opt.max_payload_bytes ||
             f.shm.nbytes % DTypeSize(static_cast<DType>(f.header.dtype), f.header.param) != 0) {
    *why = "a shared-memory push outside its region or not whole elements";
  } else {
    return std::make_shared<PushView>(region, f.shm.offset, f.shm.nbytes);
  }
  return nullptr;
}

// The reader: one frame at a time, dispatched on its type; a push goes to the
// engine thread that owns its key (or is added here when that thread is idle).
void SummationServer::Impl::ReaderLoop(ConnPtr c) {
  NameThisThread("jbps-read");
  FrameReader reader(c->fd, opt.token, stall_ms);
  bool said_bye_here = false;
  uint64_t purge_before = 0;  // a finished job's sums still held for readers that left
  std::string lost;           // why the worker is gone, if it did not say goodbye
  for (;;) {
    Frame f;
    std::string why;
    FrameStatus fs = reader.Next(&f, &why);
    if (fs == FrameStatus::kClosed) {
      lost = "was lost: its connection closed without a goodbye (killed or crashed?)";
      break;
    }
    if (fs == FrameStatus::kFailed) {
      lost = "was lost: its connection failed: " + why;
      break;
    }
    if (fs == FrameStatus::kTruncated && f.type == MsgType::kBye) {
      f.text = "(its reason did not arrive)";
      fs = FrameStatus::kOk;
    }
    if (fs == FrameStatus::kOk && f.type == MsgType::kBye) {
      said_bye_here = f.text.empty();
      lost = "left the job: " + f.text;  // a goodbye with a reason: it failed, and the others must hear why
      break;
    }
    const FrameHeader& h = f.header;
    if (fs == FrameStatus::kOk) {
      const bool from_worker = f.type == MsgType::kPush || f.type == MsgType::kPushShm || f.type == MsgType::kTree ||
                               f.type == MsgType::kRelease || f.type == MsgType::kRoutes;
      if (!from_worker)
        why = "unexpected message type";
      else if (h.sender != c->rank)
        why = "push claims another worker's rank";
    }
    Payload data;
    if (why.empty()) {
      switch (f.type) {
        case MsgType::kRelease: Release(c, h); continue;
        case MsgType::kRoutes: AnnounceRoutes(c, h.key); continue;
        case MsgType::kTree:
          if (ReadTreeCheck(c, h, &reader, &why)) continue;
          break;
        case MsgType::kPushShm: data = ShmPush(c, f, &why); break;
        default:  // kPush
          if (f.payload > opt.max_payload_bytes)
            why = "push of " + std::to_string(f.payload) + " bytes, over this server's limit of " +
                  std::to_string(opt.max_payload_bytes);
          else
            data = RecvPayload(&reader, f.payload, &why);
      }
    }
    if (!why.empty()) {
      Refuse(c->peer, "worker " + std::to_string(c->rank) + ": " + why);
      lost = "was lost: it sent a bad message: " + why;
      break;
    }
    const bool shm_push = f.type == MsgType::kPushShm;
    const uint64_t nbytes = data->size();
    ++pushes;
    bytes_received += nbytes;
    if (shm_push) bytes_shm += nbytes;
    // A TCP push is acknowledged now: its bytes are here. A shared-memory
    // one once added (Process): until then the worker must not reuse its slot.
    if (!shm_push) Ack(c, h.key, h.round);
    SumThread* e = ThreadFor(h.key, nbytes);
    if (e == nullptr) {  // the error acknowledges the push too
      SendError(c, h.key, h.round,
                "the server already tracks " + std::to_string(opt.max_keys) +
                    " keys, its limit (are tensor names unique per step?)");
      continue;
    }
    Task t{h.key, h.round, static_cast<DType>(h.dtype), c->rank, std::move(data), c, h.aux, shm_push};
    t.param = h.param;
    t.read_ns = f.read_ns;  // 0 unless the push is timed
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
  const std::string msg =
      "jbps: worker " + std::to_string(c->rank) + " (" + c->peer + ") " + what + "; seen by summation server " + Name();
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
  if (opt.keep_alive) {
    DropEndedJobs(new_epoch);
    Abort(others, msg);
    return;
  }
  FailJob(std::move(others), msg);
}

// Tells `others` why the job ended (each is disconnected after the news).
void SummationServer::Impl::Abort(const std::vector<ConnPtr>& others, const std::string& msg) {
  FrameHeader h = MakeHeader(MsgType::kAbort, opt.token);
  h.nbytes = std::min<uint64_t>(msg.size(), kMaxErrorBytes);
  for (auto& o : others) o->Finish(OutMsg{h, nullptr, msg.substr(0, h.nbytes)});
}

// Ends a job that cannot go on (failure says why): `others` hear it, and the server is finished.
void SummationServer::Impl::FailJob(std::vector<ConnPtr> others, const std::string& msg) {
  Abort(others, msg);
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
    std::stable_partition(batch.begin(), batch.end(),
                          [](const OutMsg& m) { return m.header.type == static_cast<uint16_t>(MsgType::kPushAck); });
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
  OutMsg m{RoundFrame(MsgType::kError, opt.token, key, round), nullptr, msg.substr(0, kMaxErrorBytes)};
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

}  // namespace jbps
