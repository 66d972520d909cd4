// Scheduling: chunks leave the priority queue for their connections' send
// queues under the credit window; a connection's writer takes from its send
// queue in order. All of it runs with Engine::Impl::mu held.
#include "engine/engine_impl.h"

namespace jbps {

// Moves chunks from the priority queue to their servers' send queues while
// credits last. The credit window bounds chunks on the wire, so a
// high-priority chunk that arrives now waits behind at most `credit` chunks,
// not a whole model. Run, with mu held, by whichever thread queued chunks or
// freed a credit (Submit, an acknowledgement, a skipped chunk): no thread hop
// stands between a credit and the next push. Returns the calls whose server
// was lost, to fail once mu is released (FailLost).
std::vector<Engine::Impl::Lost> Engine::Impl::DispatchLocked(bool wake_senders) {
  std::vector<Lost> lost;
  while (!stopping && queue.Ready()) {
    ChunkPtr ch = queue.Pop();
    if (ch->call->failed) continue;
    ServerConn* sc = conns[ch->server].get();
    if (sc->failed) {
      lost.push_back(Lost{ch->call, ch->server});
      continue;
    }
    queue.Take();
    ++ch->call->dispatched;
    pending[RoundKey{ch->key, ch->round}] = ch;
    if (sc->unacked.empty()) sc->unacked_since_ns = SteadyNs();
    sc->unacked.push_back(ch);
    sc->sendq.push_back(ch);
  }
  if (wake_senders) WakeSendersLocked();
  return lost;
}

// With mu held: each connection with chunks to send and nobody sending them
// wakes its sender thread.
void Engine::Impl::WakeSendersLocked() {
  for (auto& c : conns)
    if (!c->failed && !c->sending && !c->sendq.empty()) c->send_cv.notify_one();
}

// With mu held: queues a call's tree check on the connection of its
// tree_key's server (the same on every worker), with the description unless
// that connection sent it before.
void Engine::Impl::QueueTreeCheck(const ChunkPtr& tree) {
  Call* call = tree->call.get();
  tree->server = static_cast<int>(call->spec.tree_key % conns.size());
  ServerConn* sc = conns[tree->server].get();
  tree->round = next_round[tree->key]++;
  tree->seq = next_seq++;
  const uint64_t digest = call->spec.tree_digest;
  tree->payload.assign(reinterpret_cast<const char*>(&digest), sizeof(digest));
  if (sc->described_trees.count(digest) == 0) {
    const std::string& text = call->spec.tree;
    tree->payload += text;
    // The server keeps what fits its bounds, in the order it reads them.
    if (sc->described_trees.size() < kMaxDescribedTrees &&
        sc->described_tree_bytes + text.size() <= kMaxDescribedTreeBytes) {
      sc->described_trees.insert(digest);
      sc->described_tree_bytes += text.size();
    }
  }
  tree->nbytes = tree->payload.size();
  pending[RoundKey{tree->key, tree->round}] = tree;
  call->tree_round = RoundKey{tree->key, tree->round};
  sc->sendq.push_back(tree);
}

// With mu held: takes chunks from the front of sc's send queue for one write
// and marks the connection as being sent on. The sender thread (no
// direct_budget) takes what is there, waiting (with `lock`) a little for a
// shared-memory slot when the first push needs one; a direct send (the
// thread that queued them) takes pushes that need no waiting, up to
// direct_budget bytes of them (see kDirectCopyBytes).
std::vector<ChunkPtr> Engine::Impl::TakeSendable(ServerConn* sc, size_t direct_budget,
                                                 std::unique_lock<std::mutex>* lock) {
  const bool direct = direct_budget > 0;
  std::vector<ChunkPtr> batch;
  size_t taken = 0;
  size_t iovecs = 0;
  while (!sc->sendq.empty() && batch.size() < kMaxSendBatch) {
    ChunkPtr ch = sc->sendq.front();
    const size_t need = ch->tree ? 2 : 1 + std::max<size_t>(1, ch->parts.size());  // at most, as if over TCP
    if (!batch.empty() && iovecs + need > kMaxSendIovecs) break;
    iovecs += need;
    if (!ch->tree) {
      const bool in_slot = ch->nbytes <= sc->transport->slot_bytes();
      if (direct && taken + ch->nbytes > (in_slot ? direct_budget : std::min(direct_budget, kDirectSmallBytes))) break;
      if (in_slot) {
        if (sc->free_slots.empty() && !direct && batch.empty() && lock != nullptr && !sc->slots_starved) {
          // All slots parked on the server means this worker is ahead of the
          // others; their pushes free slots soon, so wait a little for one.
          // Bounded, since a peer may be on other keys: then TCP.
          sc->sending = true;  // nobody else takes from sendq meanwhile
          sc->slot_cv.wait_for(*lock, std::chrono::milliseconds(kSlotWaitMs),
                               [&] { return !sc->free_slots.empty() || sc->failed; });
          if (sc->failed || sc->sendq.empty()) break;
          sc->slots_starved = sc->free_slots.empty();
          ch = sc->sendq.front();
        }
        if (!sc->free_slots.empty()) {
          ch->slot = sc->free_slots.back();
          sc->free_slots.pop_back();
          sc->slot_of[RoundKey{ch->key, ch->round}] = ch->slot;
        } else if (direct || !batch.empty()) {
          break;  // the sender waits for a slot first
        }  // else no slot came: this push goes over TCP
      }
      taken += ch->nbytes;
    }
    sc->sendq.pop_front();
    if (opt.trace) ch->times.sent_start = NowMicros();
    batch.push_back(std::move(ch));
  }
  sc->sending = !batch.empty();
  return batch;
}

// With mu held: the direct sends (see kDirectCopyBytes) of the idle
// connections, smallest first; a connection left with chunks only its sender
// may take wakes it now, so that its copies run beside this thread's.
std::vector<std::pair<ServerConn*, std::vector<ChunkPtr>>> Engine::Impl::TakeDirectSends() {
  std::vector<std::pair<ServerConn*, std::vector<ChunkPtr>>> out;
  bool copying = false;  // one connection gets the larger budget
  for (auto& c : conns) {
    if (c->failed || c->sending || c->sendq.empty()) continue;
    std::vector<ChunkPtr> batch = TakeSendable(c.get(), copying ? kDirectSmallBytes : kDirectCopyBytes, nullptr);
    size_t bytes = 0;
    for (auto& ch : batch) bytes += ch->tree ? 0 : ch->nbytes;
    copying = copying || bytes > kDirectSmallBytes;
    if (!c->sendq.empty() && batch.empty()) c->send_cv.notify_one();
    if (batch.empty()) continue;
    if (bytes > kDirectSmallBytes) {
      out.emplace_back(c.get(), std::move(batch));  // last: the small ones go out first
    } else {
      out.emplace(out.begin(), c.get(), std::move(batch));
    }
  }
  return out;
}

void Engine::Impl::FailLost(const std::vector<Lost>& lost) {
  for (const Lost& l : lost)
    FailCall(l.call, "jbps: lost summation server " + conns[l.server]->addr.ToString() + " earlier in this job");
}

bool Engine::Impl::AckLocked(ServerConn* sc, const RoundKey& rk) {
  auto it = std::find_if(sc->unacked.begin(), sc->unacked.end(),
                         [&](const ChunkPtr& c) { return c->key == rk.key && c->round == rk.round; });
  if (it == sc->unacked.end()) return false;
  if (opt.trace) (*it)->times.acked = NowMicros();
  if (!(*it)->tree) {
    sc->bytes_acked += (*it)->nbytes;
    ++sc->chunks_acked;
  }
  queue.GiveBack();
  sc->unacked.erase(it);
  DropSkipped(sc);
  return true;
}

void Engine::Impl::DropSkipped(ServerConn* sc) {
  // Never-sent chunks give their credit back (the deque is at most `credit` long).
  for (auto it = sc->unacked.begin(); it != sc->unacked.end();) {
    if ((*it)->skipped) {
      queue.GiveBack();
      it = sc->unacked.erase(it);
    } else {
      ++it;
    }
  }
  if (sc->unacked.empty() && sc->unacked_since_ns != 0) {
    sc->unacked_ns += SteadyNs() - sc->unacked_since_ns;
    sc->unacked_since_ns = 0;
  }
}

}  // namespace jbps
