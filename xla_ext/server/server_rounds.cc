// Rounds and summation: a key's rounds run on one engine thread, which adds
// every worker's push into the round's accumulator and sends the sum to all
// of them once the last has pushed.
#include "server/server_impl.h"

namespace jbps {

SumThread* SummationServer::Impl::ThreadFor(uint64_t key, uint64_t nbytes) {
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
  return sum_threads[it->second].get();
}

void SummationServer::Impl::AnnounceRoutes(const ConnPtr& c, uint64_t epoch) {
  std::lock_guard<std::mutex> lock(routes_mu);
  if (c->epoch < routes_job) return;  // an ended job's
  if (c->epoch > routes_job || announced_routes.empty()) {
    routes_job = c->epoch;
    announced_routes.assign(opt.num_workers, 0);
  }
  uint32_t& mine = announced_routes[c->rank];
  mine = std::max(mine, static_cast<uint32_t>(std::min<uint64_t>(epoch, UINT32_MAX)));
  const uint32_t ready = *std::min_element(announced_routes.begin(), announced_routes.end());
  ready_routes.store((routes_job << 32) | ready, std::memory_order_release);
}

// Read once per sum: one atomic load, no lock on the summing threads' path.
uint32_t SummationServer::Impl::ReadyRoutes(uint64_t job) const {
  const uint64_t v = ready_routes.load(std::memory_order_acquire);
  return (v >> 32) == (job & 0xffffffffu) ? static_cast<uint32_t>(v) : 0;
}

void SummationServer::Impl::SumLoop(SumThread* e) {
  NameThisThread("jbps-sum");
  // Wakes at least this often to look for stalled rounds (NoteStalls).
  const auto tick = std::chrono::nanoseconds(std::max<int64_t>(StallNoteNs() / 4, 50'000'000));
  for (;;) {
    bool woken;
    {
      std::unique_lock<std::mutex> lock(e->mu);
      woken = e->cv.wait_for(lock, tick, [&] { return e->stop || !e->queue.empty() || e->next_epoch > e->epoch; });
      if (e->stop) return;
    }
    std::lock_guard<std::mutex> running(e->run_mu);
    if (woken) {
      Task t;
      {
        std::lock_guard<std::mutex> lock(e->mu);
        if (!e->queue.empty()) {  // readers add their own pushes only when it is empty
          t = std::move(e->queue.front());
          e->queue.pop_front();
        }
      }
      RunTask(e, t);  // without a push (t.conn null) when only a job ended
    }
    NoteStalls(e);
  }
}

int64_t SummationServer::Impl::StallNoteNs() const {
  return static_cast<int64_t>(std::min(std::max(opt.timeout_s, 1.0) * kStallNoteFraction, kStallNoteMaxSeconds) * 1e9);
}

// With e->run_mu held: tells the workers that pushed a round which has
// waited StallNoteNs() for the others which workers those are (kStall, once
// per round), so that their timeout names the stalled worker, not only the
// tensor. Scans at most once a tick.
void SummationServer::Impl::NoteStalls(SumThread* e) {
  const int64_t now = SteadyNs();
  if (now < e->next_stall_scan_ns) return;
  const int64_t after = StallNoteNs();
  e->next_stall_scan_ns = now + std::max<int64_t>(after / 4, 50'000'000);
  for (auto& kv : e->rounds) {
    RoundState& st = kv.second;
    if (st.stall_noted || !st.error.empty() || st.pushes >= static_cast<int>(opt.num_workers)) continue;
    if (now - st.first_ns < after) continue;
    st.stall_noted = true;
    std::string missing;
    int count = 0;
    for (size_t r = 0; r < st.pushed.size(); ++r) {
      if (st.pushed[r]) continue;
      missing += (count++ ? ", " : "") + std::to_string(r);
    }
    const std::string who = count == 1 ? "worker " + missing + " has" : "workers " + missing + " have";
    for (auto& w : st.waiters) {
      OutMsg m{RoundFrame(MsgType::kStall, opt.token, kv.first.key, kv.first.round), nullptr, who};
      m.header.nbytes = m.text.size();
      m.header.aux = static_cast<uint32_t>(std::min<int64_t>((now - st.first_ns) / 1'000'000, UINT32_MAX));
      Deliver(w, std::move(m));
    }
  }
}

// With e->run_mu held: drops the rounds of jobs that ended, then adds t's
// push (if any) to its round.
void SummationServer::Impl::RunTask(SumThread* e, Task& t) {
  uint64_t ended;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    ended = e->next_epoch;
  }
  if (ended > e->epoch) {
    e->rounds.clear();
    e->residuals.clear();
    e->epoch = ended;
  }
  if (!t.conn) return;
  // A failed or finished job's half-done rounds are dropped, not mixed into the next job.
  if (t.conn->epoch >= e->epoch) {
    if (t.conn->epoch > e->epoch) {
      e->rounds.clear();
      e->residuals.clear();
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
// Compressed pushes wait for the rest of the round (FinishSum sums them).
void SummationServer::Impl::Fold(RoundState& st) {
  const DType dtype = st.dtype;
  if (SumsRecords(dtype)) return;
  const size_t count = st.nbytes / DTypeSize(dtype, st.param);
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
      AccumulatorAdd(dtype, st.param, st.acc->data(), p->data(), count);
    } else if (opt.num_workers == 1) {
      if (n == 0) return;
      Payload p = take();
      st.acc = NewBlock(count * AccumulatorSize(dtype));
      AccumulatorInit(dtype, st.param, st.acc->data(), p->data(), count);
    } else {
      if (n < 2) return;
      Payload a = take();
      Payload b = take();
      st.acc = NewBlock(count * AccumulatorSize(dtype));
      AccumulatorInitSum(dtype, st.param, st.acc->data(), a->data(), b->data(), count);
    }
  }
}

// A round's sum as it travels: the accumulator itself, or narrowed back to
// the wire type (16-bit floats), or for onebit and topk the held pushes'
// records summed with the key's residual (what earlier encodings of this
// key's sums lost) and encoded, what this encoding loses kept for the next
// round. The pushes are added in the order Fold would add them (rank order
// when deterministic, else arrival order), so the sums are the same bits.
Payload SummationServer::Impl::FinishSum(RoundState& st, SumThread* e, uint64_t key) {
  if (AccumulatorIsWire(st.dtype)) return st.acc;
  Payload result = NewBlock(st.nbytes);
  if (!SumsRecords(st.dtype)) {
    AccumulatorFinish(st.dtype, st.param, result->data(), st.acc->data(), st.nbytes / DTypeSize(st.dtype, st.param));
    return result;
  }
  const bool onebit = st.dtype == DType::kOneBit;
  const size_t records = st.nbytes / DTypeSize(st.dtype, st.param);
  const size_t values = records * (onebit ? kOneBitBlock : kTopKBlock);
  std::vector<float>& residual = e->residuals[key];
  if (residual.size() != values) residual.assign(values, 0.0f);
  std::vector<const uint8_t*> pushes;
  pushes.reserve(st.held.size());
  for (const Payload& p : st.held) pushes.push_back(reinterpret_cast<const uint8_t*>(p->data()));
  auto* dst = reinterpret_cast<uint8_t*>(result->data());
  if (onebit) {
    OneBitSumWithFeedback(dst, pushes.data(), pushes.size(), residual.data(), records);
  } else {
    TopKSumWithFeedback(dst, pushes.data(), pushes.size(), residual.data(), records, st.param);
  }
  return result;
}

void SummationServer::Impl::Process(Task& t, SumThread* e) {
  const RoundKey rk{t.key, t.round};
  RoundState& st = e->rounds[rk];
  const uint64_t nbytes = t.data->size();
  if (st.pushed.empty()) {
    st.pushed.assign(opt.num_workers, false);
    st.dtype = t.dtype;
    st.param = t.param;
    st.nbytes = nbytes;
    st.first_rank = t.rank;
    st.digest = t.digest;
    st.first_ns = SteadyNs();
  }
  if (st.pushed[t.rank]) {
    // A second push of the same round from one worker is a protocol error;
    // answer it alone and leave the round to the others.
    SendError(t.conn, t.key, t.round,
              "duplicate push of key round " + std::to_string(t.round) + " from worker " + std::to_string(t.rank));
    return;
  }
  st.pushed[t.rank] = true;
  ++st.pushes;
  st.waiters.push_back(t.conn);
  st.read_ns.push_back(t.read_ns);
  st.last_read_ns = std::max(st.last_read_ns, t.read_ns);

  // Pushes of calls whose trees differ are never summed: the round fails
  // for every worker, flagged, and the tree check names the difference.
  // Pushes that differ under the same tree fail unflagged: the tree check
  // finds nothing to name, so the workers must not wait for it.
  const bool found_before = !st.error.empty();
  if (!found_before && t.digest != st.digest) {
    st.error = "workers disagree on the tree of this psum: worker " + std::to_string(st.first_rank) + " and worker " +
               std::to_string(t.rank) + " called it with different trees (round " + std::to_string(t.round) + ")";
    st.error_flags = kFlagTreeMismatch;
  } else if (!found_before && (t.dtype != st.dtype || t.param != st.param || nbytes != st.nbytes)) {
    // Elements of topk are records of its workers' keep: different keeps never add up.
    st.error = "workers disagree on this tensor: worker " + std::to_string(st.first_rank) + " pushed " +
               std::to_string(st.nbytes / DTypeSize(st.dtype, st.param)) + " elements of " +
               DTypeDescription(st.dtype, st.param) + ", worker " + std::to_string(t.rank) + " pushed " +
               std::to_string(nbytes / DTypeSize(t.dtype, t.param)) + " elements of " +
               DTypeDescription(t.dtype, t.param) + " (round " + std::to_string(t.round) + ")";
    if (t.dtype == st.dtype && t.param == st.param) {
      // The same tree cut differently: the workers' chunk settings differ.
      st.error += ": the same tree cut into different chunks, as when the workers' JBPS_PARTITION_BYTES differ";
    }
  } else if (found_before) {
    SendError(t.conn, t.key, t.round, st.error, st.error_flags);
  }
  if (!found_before && !st.error.empty()) {
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
    Fold(st);
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
    Payload result = FinishSum(st, e, t.key);
    int readers = 0;
    for (auto& w : st.waiters) readers += w->shm.load(std::memory_order_acquire);
    if (readers > 0) result = InArena(std::move(result));
    const bool shared = readers > 0 && result->arena_offset() >= 0;
    if (shared) {  // held until every shared-memory worker has copied it out (kRelease)
      std::lock_guard<std::mutex> lock(holds_mu);
      holds[JobRoundKey{t.conn->epoch, t.key, t.round}] = Hold{result, readers};
    }
    FrameHeader h = RoundFrame(MsgType::kSum, opt.token, t.key, t.round);
    h.dtype = static_cast<uint8_t>(st.dtype);
    h.param = st.param;
    h.nbytes = static_cast<uint32_t>(st.nbytes);
    h.routes = ReadyRoutes(t.conn->epoch);  // once per round: every worker reads the same
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
