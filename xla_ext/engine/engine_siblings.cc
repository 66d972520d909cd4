// A psum's calls of one step on the worker's local devices complete
// together. XLA:CPU gathers the devices' summed shards after the calls (an
// all-gather across the local devices): a device whose call returned goes on
// to it and waits there for the others. Were one device's call to fail (a
// lost peer) after another's had returned, that device's program would stop
// and the other would wait in the all-gather until XLA aborts the process.
// So a call's result is handed over only once the same step's calls of all
// the worker's devices are complete; when one fails, it and those held fail
// at once with its error, and so do the step's calls still to come. The k-th
// call of a psum on each device belongs to the same step.
#include "engine/engine_impl.h"

namespace jbps {
namespace {

std::string Devices(const std::vector<bool>& arrived, bool which) {
  std::string out;
  for (size_t i = 0; i < arrived.size(); ++i) {
    if (arrived[i] != which) continue;
    if (!out.empty()) out += ", ";
    out += std::to_string(i);
  }
  return out;
}

}  // namespace

void Engine::Impl::NumberSibling(HeldCall* held) {
  CallSpec& spec = held->spec;
  if (spec.slots <= 1) return;
  if (spec.shard >= spec.slots) {
    spec.slots = 1;  // not one of a step's device calls: completes alone
    return;
  }
  std::lock_guard<std::mutex> lock(siblings_mu);
  std::vector<uint64_t>& next = sibling_next[{PsumKey(spec), spec.slots}];
  if (next.size() != spec.slots) next.assign(spec.slots, 0);
  held->sibling_seq = next[spec.shard]++;
}

void Engine::Impl::ArriveSibling(Call* c, Delivery d) {
  const CallSpec& spec = c->spec;
  const SiblingKey key{PsumKey(spec), spec.slots, c->sibling_seq};
  std::vector<Delivery> now;  // handed over once the lock is released
  bool held = false;
  {
    std::lock_guard<std::mutex> lock(siblings_mu);
    auto [it, fresh] = siblings.try_emplace(key);
    SiblingGroup& g = it->second;
    if (fresh) {
      g.arrived.assign(spec.slots, false);
      g.name = c->TensorName(0);
      g.deadline = DeadlineFromNow();
    }
    g.arrived[spec.shard] = true;
    ++g.count;
    if (!d.error.empty() && g.error.empty()) {
      // A failed call is handed over at once (its device's program stops there), and so
      // are the others' held results, failed with it: none of them may go on alone.
      g.error = d.error;
      for (Delivery& h : g.held) {
        h.error = g.error;
        now.push_back(std::move(h));
      }
      g.held.clear();
    }
    if (!g.error.empty()) {
      if (d.error.empty()) d.error = g.error;
      now.push_back(std::move(d));
    } else {
      g.held.push_back(std::move(d));
      held = true;
    }
    if (g.count == spec.slots) {
      for (Delivery& h : g.held) now.push_back(std::move(h));  // every device's call succeeded
      siblings.erase(it);
      held = false;
    }
  }
  if (held) {
    // The watchdog bounds the wait for the other devices' calls. With a call
    // in flight it wakes by that call's deadline, which is earlier, and sees
    // this step then: it is woken here only when it waits for nothing.
    bool idle;
    {
      std::lock_guard<std::mutex> lock(mu);
      idle = active.empty();
    }
    if (idle) watchdog_cv.notify_one();
  }
  for (Delivery& r : now) Deliver(std::move(r));
}

std::optional<Clock::time_point> Engine::Impl::NextSiblingDeadline() {
  std::lock_guard<std::mutex> lock(siblings_mu);
  std::optional<Clock::time_point> first;
  for (auto& kv : siblings) {
    if (!first || kv.second.deadline < *first) first = kv.second.deadline;
  }
  return first;
}

void Engine::Impl::ExpireSiblings(bool all, const std::string& why) {
  std::vector<Delivery> failed;
  {
    std::lock_guard<std::mutex> lock(siblings_mu);
    const Clock::time_point now = Clock::now();
    for (auto it = siblings.begin(); it != siblings.end();) {
      SiblingGroup& g = it->second;
      if (!all && now < g.deadline) {
        ++it;
        continue;
      }
      std::string error = g.error;
      if (error.empty() && all) error = why;
      if (error.empty()) {
        error = "jbps: psum '" + g.name + "': local device " + Devices(g.arrived, false) +
                " never made its call of this step within " + FormatSeconds(opt.timeout_s) +
                " s (JBPS_TIMEOUT_S), which local device " + Devices(g.arrived, true) +
                " completed: did that device's program stop at an earlier error?";
      }
      // The missing devices' calls of this step are given up: their next
      // call belongs to the next step.
      std::vector<uint64_t>& next = sibling_next[{it->first.psum, it->first.slots}];
      for (size_t s = 0; s < g.arrived.size() && s < next.size(); ++s) {
        if (!g.arrived[s]) next[s] = std::max(next[s], it->first.seq + 1);
      }
      for (Delivery& d : g.held) {
        if (d.error.empty()) d.error = error;
        failed.push_back(std::move(d));
      }
      it = siblings.erase(it);
    }
    if (all) sibling_next.clear();
  }
  for (Delivery& d : failed) Deliver(std::move(d));
}

}  // namespace jbps
