// A server connection: its sender (pushes, by shared memory or TCP), its
// receiver (acknowledgements, sums, errors), the shared-memory attach, and
// what a lost connection does to the calls that needed it.
#include "engine/engine_impl.h"
#include "wire/frame.h"

namespace jbps {

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
    o.h.param = call->spec.operands[ch->op].param;
    o.h.aux = static_cast<uint32_t>(call->spec.tree_digest);
  }
  std::vector<struct iovec> iov;
  std::vector<Segment> parts;
  for (Outgoing& o : out) {
    iov.push_back({&o.h, sizeof(o.h)});
    if (o.ch->tree) {
      iov.push_back({const_cast<char*>(o.ch->payload.data()), o.ch->payload.size()});
      continue;
    }
    parts.clear();
    for (const Part& p : o.ch->parts)
      parts.push_back({static_cast<const char*>(o.ch->call->spec.operands[p.op].in) + p.offset, p.nbytes});
    // The transport says where the bytes travel: after the header (TCP, straight
    // from XLA's buffers, gathered by sendmsg), or copied into the chunk's slot.
    sc->transport->StagePush(o.ch->slot, parts, o.ch->nbytes, &o.h, &o.ref, &iov);
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

// The receiver: one frame at a time, dispatched on its type.
void Engine::Impl::RecvLoop(ServerConn* sc) {
  NameThisThread("jbps-pull");
  FrameReader reader(sc->fd, opt.token, stall_ms);
  for (;;) {
    if (sc->transport->slots() > 0 && sc->awaiting.load(std::memory_order_relaxed) == 1)
      SpinUntilReadable(sc->fd, SteadyNs() + kReceiverSpinNs);
    Frame f;
    std::string why;
    FrameStatus fs = reader.Next(&f, &why, /*stamp=*/stage_timing.load(std::memory_order_relaxed));
    if (fs != FrameStatus::kOk) {
      ConnFailed(sc, fs == FrameStatus::kBadHeader ? "protocol error: " + why : why);
      return;
    }
    bool ok = true;
    switch (f.type) {
      case MsgType::kPushAck: {
        // TCP pushes are acknowledged in order as they arrive; shared-memory
        // ones once added, by whichever server thread owns the key.
        std::vector<Lost> lost;
        {
          std::lock_guard<std::mutex> lock(mu);
          AckLocked(sc, RoundKey{f.header.key, f.header.round});
          lost = DispatchLocked();
        }
        FailLost(lost);
        break;
      }
      case MsgType::kAbort: OnAbort(sc, f.text); break;
      case MsgType::kError: ok = OnError(sc, f, &why); break;
      case MsgType::kStall: OnStall(sc, f); break;
      case MsgType::kSum:
      case MsgType::kSumShm: ok = OnSum(sc, f, &reader, &why); break;
      default: ok = false; why = "protocol error: unexpected message type " + std::to_string(f.header.type);
    }
    if (!ok) {
      ConnFailed(sc, why);
      return;
    }
  }
}

// A round answered (its sum or an error): its chunk, no longer pending, or
// null when its call is gone; the push's slot and credit come back.
ChunkPtr Engine::Impl::TakeAnswered(ServerConn* sc, const Frame& f) {
  ChunkPtr ch;
  std::vector<Lost> lost;
  {
    std::lock_guard<std::mutex> lock(mu);
    const RoundKey rk{f.header.key, f.header.round};
    auto it = pending.find(rk);
    if (it != pending.end()) {
      ch = it->second;
      pending.erase(it);
    }
    if (f.type != MsgType::kError || (ch && !ch->tree)) sc->awaiting.fetch_sub(1, std::memory_order_relaxed);
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
  return ch;
}

// kAbort: the server ended the job (a worker was lost) and closes the
// connection. Every later call fails. The pending ones go on only if none
// waits on this server (which sends its sums ahead of its abort) and none
// has chunks not yet pushed: what they wait for is on other servers, whose
// own news decides (a sum, or an abort that finds them waiting there). So a
// step the lost worker finished completes here too, whichever server's news
// comes first. Otherwise all of them fail, as one: separate psums of a step
// must not part, one handed back and one failed (docs/limitations.md: a
// device could be left in the first's all-gather).
void Engine::Impl::OnAbort(ServerConn* sc, const std::string& msg) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (stopping) return;
    sc->aborted = true;
    bool all_summed = true;
    for (auto& kv : pending) all_summed = all_summed && (kv.second->server != sc->index || kv.second->tree);
    for (auto& kv : active) all_summed = all_summed && kv.second->dispatched == kv.second->total_chunks;
    if (all_summed) {
      if (fault.empty()) fault = msg;
      return;
    }
  }
  SetFault(msg, /*said_by_server=*/true);
}

// kError: fails the call it names (a tree check's error names the leaf, so a
// tensor's error that says the trees differ waits for it); key 0 is about the
// connection itself. False, with *why, when the connection cannot go on.
bool Engine::Impl::OnError(ServerConn* sc, const Frame& f, std::string* why) {
  ChunkPtr ch = TakeAnswered(sc, f);
  const std::string server = sc->addr.ToString();
  if (ch && ch->tree) {
    const std::string msg = "jbps: " + f.text + " (server " + server + ")";
    {
      std::lock_guard<std::mutex> lock(ch->call->mu);
      ch->call->tree_pending = false;
      ch->call->tree_error = msg;
      if (ch->call->timed) ch->call->stage.tree_checked = f.read_ns;
    }
    FailCall(ch->call, msg);
  } else if (ch) {
    std::string msg =
        "jbps: psum of tensor '" + ch->call->TensorName(ch->op) + "' failed on server " + server + ": " + f.text;
    bool defer = false;
    if (f.header.flags & kFlagTreeMismatch) {  // the tree check's error names the leaf: wait for it
      std::lock_guard<std::mutex> lock(ch->call->mu);
      if (!ch->call->tree_error.empty()) {
        msg = ch->call->tree_error;  // read already, its FailCall maybe not yet made: the same words
      } else {
        defer = ch->call->tree_pending;
        if (defer && ch->call->deferred.empty()) ch->call->deferred = msg;
      }
    }
    if (!defer) FailCall(ch->call, msg);
  } else if (f.header.key == 0) {
    *why = f.text;
    return false;
  }
  return true;
}

// kStall: a round of one of our calls waits on workers that have not pushed
// it; the call's timeout names them (TimeoutMessage). The round stays pending.
void Engine::Impl::OnStall(ServerConn* sc, const Frame& f) {
  CallPtr call;
  int op = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = pending.find(RoundKey{f.header.key, f.header.round});
    if (it == pending.end() || it->second->tree) return;
    call = it->second->call;
    op = it->second->op;
  }
  char waited[32];
  std::snprintf(waited, sizeof(waited), "%.1f", f.header.aux / 1000.0);
  const std::string note = f.text + " not pushed tensor '" + call->TensorName(op) + "' (round " +
                           std::to_string(f.header.round) + ") to server " + sc->addr.ToString() +
                           ", which had waited " + waited + " s for it";
  std::lock_guard<std::mutex> lock(call->mu);
  if (call->stalled.empty()) call->stalled = note;
}

// kSum / kSumShm: the sum lands in the call's output buffers (read from the
// socket into them, or copied out of the server's arena), or is dropped when
// its call is gone. False, with *why, when the connection cannot go on.
bool Engine::Impl::OnSum(ServerConn* sc, const Frame& f, FrameReader* reader, std::string* why) {
  if (!sc->transport->CheckSum(f, why)) return false;
  ChunkPtr ch = TakeAnswered(sc, f);
  if (ch && ch->tree) {  // a tree check is answered only when the trees differ
    *why = "protocol error: a tree check answered with a sum";
    return false;
  }
  const uint64_t sum_bytes = Transport::SumBytes(f);
  bool wanted = ch && ch->call->TryAcquire();
  if (wanted) {
    const Operand& op = ch->call->spec.operands[ch->op];
    if (sum_bytes != ch->nbytes || f.header.dtype != static_cast<uint8_t>(op.dtype) || f.header.param != op.param) {
      FailCall(ch->call, "jbps: server " + sc->addr.ToString() + " returned " + std::to_string(sum_bytes) +
                             " bytes for tensor '" + ch->call->TensorName(ch->op) + "', expected " +
                             std::to_string(ch->nbytes));
      ReleaseIo(ch->call.get());
      wanted = false;
    }
  }
  if (opt.trace && wanted) ch->times.sum_arrived = NowMicros();
  std::vector<Destination> out;
  if (wanted) {  // the sum's bytes go straight into the parts' outputs
    for (const Part& p : ch->parts)
      out.push_back({static_cast<char*>(ch->call->spec.operands[p.op].out) + p.offset, p.nbytes});
  }
  const bool ok = sc->transport->TakeSum(f, reader, wanted ? &out : nullptr, why);
  if (wanted) {
    if (ok) {
      if (f.type == MsgType::kSumShm) bytes_shm += sum_bytes;
      bytes_pulled += ch->nbytes;
      sc->bytes_pulled += ch->nbytes;
      RaiseTo(ch->call->routes_seen, f.header.routes);
      if (opt.trace) Record(*ch, NowMicros());
      if (ch->call->timed) StampSum(ch->call.get(), f.header, f.read_ns);
      ChunkDone(ch->call.get());
    }
    ReleaseIo(ch->call.get());  // the call may complete now: the release below is not on its path
  }
  if (!ok || f.type != MsgType::kSumShm) return ok;
  const IoStatus st = SendRelease(sc, f.header);  // wanted or not, the server may reuse the block
  if (st != IoStatus::kOk) *why = std::string("releasing a sum: ") + IoStatusName(st);
  return st == IoStatus::kOk;
}

IoStatus Engine::Impl::SendRelease(ServerConn* sc, const FrameHeader& sum) {
  FrameHeader r = RoundFrame(MsgType::kRelease, opt.token, sum.key, sum.round);
  r.sender = opt.rank;
  struct iovec iov = {&r, sizeof(r)};
  std::lock_guard<std::mutex> lock(sc->write_mu);
  return SendAll(sc->fd, &iov, 1, stall_ms);
}

// Shared memory with a server on this host (transport/transport.h): the push
// slots are more than the credit, since a slot stays the server's until its
// sum arrives, which can be long after the credit's acks when this worker is
// ahead of the others. A server on another host has no shared-memory socket
// here, so the connection stays on TCP; so does any other failure, with a warning.
void Engine::Impl::AttachShm(ServerConn* sc) {
  if (sc->instance == 0) return;  // the server offers no shared memory
  const size_t slots = kSlotsPerCredit * static_cast<size_t>(opt.credit);
  const size_t slot_bytes = std::max<size_t>(opt.shm_slot_bytes, 4096);
  std::string err;
  auto shm = ShmTransport::Attach(opt.token, sc->instance, opt.rank, slots, slot_bytes, stall_ms, &err);
  if (!shm) {
    if (!err.empty())
      LogWarning("jbps: shared memory with server %s failed (%s); using TCP", sc->addr.ToString().c_str(), err.c_str());
    return;
  }
  sc->transport = std::move(shm);
  for (size_t i = slots; i-- > 0;) sc->free_slots.push_back(static_cast<int>(i));
}

void Engine::Impl::ConnFailed(ServerConn* sc, const std::string& why) {
  std::vector<CallPtr> victims;
  bool quiet, aborted, first = false;
  const std::string msg = "jbps: lost summation server " + sc->addr.ToString() + ": " + why;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (sc->failed) return;
    sc->failed = true;
    sc->slot_cv.notify_all();
    quiet = stopping;
    aborted = sc->aborted;
    // The job's fault goes with the failed connection, under one lock: a call
    // launched from now on fails at launch (FailLost), and whoever then asks
    // why (an elastic worker deciding to regroup) must find the fault set.
    if (!quiet && !aborted && fault.empty()) {
      fault = msg;
      first = true;
    }
    queue.GiveBack(static_cast<int>(sc->unacked.size()));
    sc->unacked.clear();
    for (auto& ch : sc->sendq) victims.push_back(ch->call);
    sc->sendq.clear();
    for (auto& kv : pending)
      if (kv.second->server == sc->index) victims.push_back(kv.second->call);
    sc->send_cv.notify_all();
    for (const Lost& l : DispatchLocked()) victims.push_back(l.call);  // its credits go to the others
  }
  ShutdownFd(sc->fd);  // wakes this connection's other thread
  if (quiet) {
    for (auto& c : victims) FailCall(c, msg);
    return;
  }
  // The aborting server's own close is no news: its abort failed every
  // pending call, or spared them all, when none had a chunk still to push or
  // waiting here (a spared call's tree check may: it is answered only when
  // the trees differ), and every later call fails at launch with its cause.
  if (aborted) return;
  // A job without one of its servers cannot sum: fail everything, now and
  // later, with the job's first cause (an abort's, where one came first).
  if (first) LogWarning("%s", msg.c_str());
  SetFault(msg);
}

}  // namespace jbps
