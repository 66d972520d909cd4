// The engine's orchestration: start (connect, hello, shared memory, threads),
// stop, and a call's submission: cut into chunks and queued (engine_impl.h
// says which file holds the rest).
#include <cmath>

#include "engine/engine_impl.h"

namespace jbps {

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
    impl_->queue.set_credit(credit);
    lost = impl_->DispatchLocked();
  }
  impl_->FailLost(lost);
  return true;
}

bool Engine::all_servers_local() const { return impl_->all_local.load(std::memory_order_relaxed); }

bool Engine::huge_pages() const { return impl_->huge_pages.load(std::memory_order_relaxed); }

uint32_t Engine::num_workers() const { return impl_->num_workers.load(std::memory_order_relaxed); }

bool Engine::SetRehearsal(uint32_t workers, std::string* err) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->running && workers > 0) {
    *err = "a rehearsal runs before the engine starts, and the engine is running";
    return false;
  }
  impl_->rehearsal.store(workers, std::memory_order_relaxed);
  return true;
}

uint32_t Engine::rehearsal() const { return impl_->rehearsal.load(std::memory_order_relaxed); }

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
  const int64_t now = SteadyNs();
  for (auto& c : impl_->conns) {
    s.shm_servers += c->transport->slots() > 0;
    s.server_shared_memory.push_back(c->transport->slots() > 0);
    s.server_bytes_pushed.push_back(c->bytes_pushed.load());
    s.server_bytes_pulled.push_back(c->bytes_pulled.load());
    s.server_bytes_acked.push_back(c->bytes_acked);
    s.server_chunks_acked.push_back(c->chunks_acked);
    // With the stretch still open: a reading taken mid-call counts the time its acknowledged bytes took.
    const int64_t open = c->unacked_since_ns != 0 ? now - c->unacked_since_ns : 0;
    s.server_unacked_seconds.push_back((c->unacked_ns + open) * 1e-9);
  }
  s.routes_used = impl_->routes_used.load();
  std::lock_guard<std::mutex> routes(impl_->lines_mu);
  s.routes_announced = impl_->routes_announced;
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

bool Engine::Start(const EngineOptions& options, std::string* err) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.running) {
    *err = "the jbps engine is already running";
    return false;
  }
  s.rehearsal.store(0, std::memory_order_relaxed);  // a job's calls are never a rehearsal's
  if (options.servers.empty()) {
    *err = "no summation servers given";
    return false;
  }
  if (options.num_workers < 1 || options.rank >= options.num_workers) {
    *err = "worker rank " + std::to_string(options.rank) + " out of range for " + std::to_string(options.num_workers) +
           " workers";
    return false;
  }
  if (options.credit < 1 || options.timeout_s <= 0) {
    *err = "credit must be >= 1 and timeout_s > 0";
    return false;
  }
  s.opt = options;
  s.routes_can_change = options.routes_can_change;
  s.queue.set_credit(options.credit);
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
    FrameHeader hello = HelloFrame(options.token, options.rank, options.num_workers);
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
    c.instance = HelloOkInstance(reply);
  }
  if (options.shm) {
    for (auto& c : conns) s.AttachShm(c.get());
  }
  s.all_local = std::all_of(conns.begin(), conns.end(), [](const auto& c) { return c->transport->slots() > 0; });
  s.huge_pages = options.huge_pages;
  s.num_workers = options.num_workers;
  {
    std::lock_guard<std::mutex> lock(s.dealt_mu);
    s.dealt_fractions.clear();  // the last generation's
  }
  s.conns = std::move(conns);
  s.roles = std::move(roles);
  {
    // Steps of calls made while the engine was stopped (each failed at once) are forgotten.
    std::lock_guard<std::mutex> lock(s.siblings_mu);
    s.siblings.clear();
    s.sibling_next.clear();
  }
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
  s.ExpireSiblings(/*all=*/true, "jbps: shut down while this psum was pending");
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
  {
    std::lock_guard<std::mutex> lock(s.lines_mu);
    s.lines.clear();  // every held call was launched, and failed, above
    s.route_fractions.clear();
    s.routes_announced = 0;
    s.routes_used = 0;
  }
  std::lock_guard<std::mutex> lock(s.mu);
  s.conns.clear();
  s.queue.Clear();
  s.pending.clear();
  s.next_round.clear();
  s.active.clear();
  s.roles.clear();
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
  HeldCall held{std::move(spec), std::move(done), std::move(early), submitted};
  s.NumberSibling(&held);
  s.SubmitInLine(std::move(held));
}

// A psum's line: its tree on one device (its first tensor's, without a tree).
static uint64_t LineOf(const CallSpec& spec) {
  if (spec.operands.empty()) return 0;
  return ChunkKey(PsumKey(spec), spec.shard, 0) | 1;  // never 0
}

// Where routes can change, a line's calls go one at a time: a call is routed
// by the epoch its line's previous call's sums carried, which every worker
// reads alike only once that call is complete.
void Engine::Impl::SubmitInLine(HeldCall held) {
  const uint64_t line = routes_can_change.load() ? LineOf(held.spec) : 0;
  if (line == 0) return Launch(std::move(held), 0, 0);
  uint32_t epoch;
  {
    std::lock_guard<std::mutex> lock(lines_mu);
    Line& l = lines[line];
    if (l.busy) {
      l.held.push_back(std::move(held));
      return;
    }
    l.busy = true;
    epoch = l.epoch;
  }
  Launch(std::move(held), line, epoch);
}

void Engine::Impl::NextInLine(uint64_t line, uint32_t seen) {
  HeldCall next;
  uint32_t epoch;
  {
    std::lock_guard<std::mutex> lock(lines_mu);
    Line& l = lines[line];
    l.epoch = std::max(l.epoch, seen);
    if (l.held.empty()) {
      l.busy = false;
      return;
    }
    next = std::move(l.held.front());
    l.held.pop_front();
    epoch = l.epoch;
  }
  Launch(std::move(next), line, epoch);
}

namespace {

// `fractions` as shares of 1 into *out, or false with *err unless they are
// one finite, non-negative number per server adding up to more than 0.
bool Normalized(const std::vector<double>& fractions, size_t servers, std::vector<double>* out, std::string* err) {
  if (fractions.size() != servers) {
    *err = std::to_string(fractions.size()) + " shares for " + std::to_string(servers) + " servers";
    return false;
  }
  double total = 0;
  for (double f : fractions) {
    if (!std::isfinite(f) || f < 0) {
      *err = "a share that is not a finite, non-negative number: " + std::to_string(f);
      return false;
    }
    total += f;
  }
  if (total <= 0) {
    *err = "shares that add up to 0";
    return false;
  }
  out->clear();
  for (double f : fractions) out->push_back(f / total);
  return true;
}

}  // namespace

bool Engine::SetDealtSplit(const std::vector<double>& fractions, std::string* err) {
  Impl& s = *impl_;
  size_t servers;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    servers = s.conns.size();
  }
  std::vector<double> shares;
  if (!Normalized(fractions, servers, &shares, err)) return false;
  std::lock_guard<std::mutex> lock(s.dealt_mu);
  s.dealt_fractions = std::move(shares);
  return true;
}

uint32_t Engine::SetRoutes(const std::vector<double>& fractions, std::string* err) {
  Impl& s = *impl_;
  std::vector<ServerConn*> conns;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.running || s.stopping) {
      *err = "the jbps engine is not running";
      return 0;
    }
    if (!s.routes_can_change.load()) {
      *err = "this job's routes cannot change (EngineOptions.routes_can_change)";
      return 0;
    }
    for (auto& c : s.conns) conns.push_back(c.get());
  }
  std::vector<double> shares;
  if (!Normalized(fractions, conns.size(), &shares, err)) return 0;
  uint32_t epoch;
  {
    std::lock_guard<std::mutex> lock(s.lines_mu);
    epoch = ++s.routes_announced;
    s.route_fractions[epoch] = std::move(shares);
    // Lines follow what the servers stamp, never beyond the last few epochs.
    while (s.route_fractions.size() > 64) s.route_fractions.erase(s.route_fractions.begin());
  }
  FrameHeader h = MakeHeader(MsgType::kRoutes, s.opt.token);
  h.key = epoch;
  h.sender = s.opt.rank;
  for (ServerConn* sc : conns) {
    struct iovec iov = {&h, sizeof(h)};
    std::lock_guard<std::mutex> lock(sc->write_mu);
    SendAll(sc->fd, &iov, 1, s.stall_ms);  // a failed connection fails the job on its own
  }
  return epoch;
}

void Engine::Impl::Launch(HeldCall held, uint64_t line, uint32_t epoch) {
  Impl& s = *this;
  const int64_t submitted = held.submitted;
  auto call = std::make_shared<Call>();
  call->engine = &s;
  call->spec = std::move(held.spec);
  call->done = std::move(held.done);
  call->early = std::move(held.early);
  call->line = line;
  call->sibling_seq = held.sibling_seq;
  if (submitted != 0) {
    call->timed = true;
    call->stage.submitted = submitted;
    call->stage.name = call->TensorName(0);
    for (const Operand& op : call->spec.operands) call->stage.bytes += op.nbytes;
  }
  std::vector<ChunkPtr> chunks;
  const size_t partition = std::max<size_t>(call->spec.partition_bytes, 1);
  std::string bad_table = CheckChunkTable(call->spec);
  if (bad_table.empty() && !call->spec.servers.empty() && call->spec.servers[0] < 0) {
    // A program that routes to no server (an elastic job's): dealt by the
    // generation's split (SetDealtSplit), as every worker of it does.
    std::vector<double> fractions;
    {
      std::lock_guard<std::mutex> lock(s.dealt_mu);
      fractions = s.dealt_fractions;
    }
    if (fractions.empty()) {
      bad_table = "its program routes to no server, and this engine has no split to deal its chunks by";
    } else {
      call->spec.servers = DealChunks(call->spec, fractions);
    }
  }
  if (epoch > 0 && !call->spec.fixed_routes && bad_table.empty()) {
    std::vector<double> fractions;
    {
      std::lock_guard<std::mutex> lock(s.lines_mu);
      auto it = s.route_fractions.find(epoch);
      if (it != s.route_fractions.end()) fractions = it->second;
    }
    if (fractions.empty()) {
      bad_table = "route epoch " + std::to_string(epoch) + " is no longer known here";
    } else {
      call->spec.servers = DealChunks(call->spec, fractions);
      RaiseTo(s.routes_used, epoch);
    }
  }
  size_t next = 0;  // in the chunk table, which also orders the routes
  for (size_t i = 0; i < call->spec.operands.size() && bad_table.empty(); ++i) {
    const Operand& op = call->spec.operands[i];
    const uint32_t n = call->spec.chunk_counts[i];
    size_t offset = 0;
    for (uint32_t c = 0; c < n; ++c, ++next) {
      auto ch = std::make_shared<Chunk>();
      ch->call = call;
      ch->op = static_cast<int>(i);
      ch->dtype = op.dtype;
      ch->param = op.param;
      ch->nbytes = call->spec.chunk_bytes[next];
      ch->alone = call->spec.chunk_alone[next] != 0;
      ch->parts.push_back(Part{ch->op, offset, ch->nbytes});
      offset += ch->nbytes;
      ch->key = ChunkKey(op.base_key, call->spec.shard, c);
      ch->priority = op.priority;
      ch->server = call->spec.servers[next];
      chunks.push_back(std::move(ch));
    }
  }
  uint64_t fused = 0;
  chunks = FuseSmallChunks(std::move(chunks), partition, call->spec.shard, &fused);
  s.chunks_fused += fused;
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
    } else if (!bad_table.empty()) {
      fail = "jbps: psum '" + call->TensorName(0) + "': " + bad_table + " (internal error: a bad plan)";
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
      call->deadline = s.DeadlineFromNow();
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
        s.queue.Push(ch);
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

}  // namespace jbps
