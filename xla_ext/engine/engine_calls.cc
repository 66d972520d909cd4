// A call's lifetime: I/O references, completion on the device's completion
// thread, failure, the watchdog's deadlines, stage stamps and the trace.
#include "engine/engine_impl.h"

namespace jbps {

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
  std::string stalled;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    remaining = c->remaining;
    if (!c->deferred.empty()) return c->deferred;  // a known cause beats "timed out"
    stalled = c->stalled;
  }
  if (!stalled.empty()) return msg + ": " + stalled + ": is it stuck (or gone), or calling psum with a different tree?";
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
    // A step some local device has not completed (engine_siblings.cc).
    const std::optional<Clock::time_point> step = NextSiblingDeadline();
    if (step && Clock::now() >= *step) {
      lock.unlock();
      ExpireSiblings(/*all=*/false, "");
      lock.lock();
      continue;
    }
    if (active.empty()) {
      if (step) {
        watchdog_cv.wait_until(lock, *step);
      } else {
        watchdog_cv.wait(lock);
      }
      continue;
    }
    CallPtr first = active.begin()->second;
    if (Clock::now() < first->deadline) {
      watchdog_cv.wait_until(lock, step ? std::min(*step, first->deadline) : first->deadline);
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
  // Its line's next call may go now, routed by the epoch its sums carried (a
  // failed call's may be partial, so the line keeps its epoch).
  if (c->line != 0) NextInLine(c->line, c->failed ? 0 : c->routes_seen.load());
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
  Delivery d{std::move(c->done), std::move(c->early), std::move(stage), c->spec.shard, c->error};
  if (c->spec.slots > 1) {
    ArriveSibling(c, std::move(d));  // with the same step's calls of the other devices
  } else {
    Deliver(std::move(d));
  }
}

void Engine::Impl::Deliver(Delivery d) {
  if (d.early) {
    const int64_t handed = d.stage ? SteadyNs() : 0;
    if (d.early(d.error)) {
      if (d.stage) KeepStage(std::move(*d.stage), handed);
      return;
    }
  }
  std::function<void()> fn = [this, done = std::move(d.done), error = std::move(d.error),
                              stage = std::move(d.stage)]() mutable {
    if (stage) KeepStage(std::move(*stage), SteadyNs());
    done(error);
  };
  std::lock_guard<std::mutex> lock(completer_mu);
  auto& completer = completers[d.shard];
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

// The job cannot go on: every pending call fails, and every later one, with
// its first cause (what later ones say adds nothing). It can be set already
// by an abort that spared the pending calls (OnAbort), which fail here then.
void Engine::Impl::SetFault(const std::string& msg, bool said_by_server) {
  std::vector<CallPtr> victims;
  std::string cause;
  bool first;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (stopping) return;
    first = fault.empty();
    if (first) fault = msg;
    cause = fault;
    for (auto& kv : active) victims.push_back(kv.second);
  }
  // A server that ends the job says why itself, and every psum here fails
  // with it: this worker says it only when it alone saw it (a lost server).
  if (first && !said_by_server) LogWarning("%s", msg.c_str());
  for (auto& c : victims) FailCall(c, cause);
}

}  // namespace jbps
