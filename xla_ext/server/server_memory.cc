// Where sums live: the shared arena while a colocated worker can read them
// there, else the heap (buffers reused round after round); a sum in the
// arena is held until its readers release it, and what an ended job held goes.
#include "server/server_impl.h"

namespace jbps {

Payload SummationServer::Impl::NewBlock(size_t n) {
  // In the arena while some worker can read sums there; on the heap otherwise.
  if (arena && shm_workers.load() > 0) {
    int64_t offset = arena->Allocate(n);
    if (offset >= 0) return std::make_shared<ArenaBlock>(arena, offset, n);
  }
  return HeapBlockOf(n);
}

Payload SummationServer::Impl::HeapBlockOf(size_t n) {
  if (!BufferPool::Keeps(n)) return std::make_shared<HeapBlock>(n);
  return std::make_shared<HeapBlock>(buffers->Take(n), buffers);
}

std::unique_ptr<AlignedBuffer> BufferPool::Take(size_t n) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {  // the most recently freed is warmest
      if ((*it)->size() != n) continue;
      std::unique_ptr<AlignedBuffer> buf = std::move(*it);
      free_.erase(std::next(it).base());
      bytes_ -= n;
      return buf;
    }
  }
  return std::make_unique<AlignedBuffer>(n);
}

void BufferPool::Give(std::unique_ptr<AlignedBuffer> buf) {
  std::lock_guard<std::mutex> lock(mu_);
  bytes_ += buf->size();
  free_.push_back(std::move(buf));
  while (bytes_ > kMaxBytes) {  // the oldest go back to malloc
    bytes_ -= free_.front()->size();
    free_.pop_front();
  }
}

Payload SummationServer::Impl::InArena(Payload p) {
  if (!arena || p->arena_offset() >= 0) return p;
  int64_t offset = arena->Allocate(p->size());
  if (offset < 0) return p;  // arena full: this sum goes over TCP
  auto block = std::make_shared<ArenaBlock>(arena, offset, p->size());
  std::memcpy(block->data(), p->data(), p->size());
  return block;
}

void SummationServer::Impl::Release(const ConnPtr& c, const FrameHeader& h) {
  std::lock_guard<std::mutex> lock(holds_mu);
  auto it = holds.find(JobRoundKey{c->epoch, h.key, h.round});
  if (it != holds.end() && --it->second.readers == 0) holds.erase(it);  // the block goes back to the arena
}

// A job ended (keep-alive servers go on): its sums still held for readers,
// and its unfinished rounds with the pushes they read in place, go now, so
// no departed worker's region stays mapped.
void SummationServer::Impl::DropEndedJobs(uint64_t before_epoch) {
  {
    std::lock_guard<std::mutex> lock(holds_mu);
    for (auto it = holds.begin(); it != holds.end();)
      it = it->first.epoch < before_epoch ? holds.erase(it) : std::next(it);
  }
  {
    std::lock_guard<std::mutex> lock(trees_mu);
    for (auto it = tree_rounds.begin(); it != tree_rounds.end();)
      it = it->first.epoch < before_epoch ? tree_rounds.erase(it) : std::next(it);
  }
  for (auto& e : sum_threads) {
    {
      std::lock_guard<std::mutex> lock(e->mu);
      e->next_epoch = std::max(e->next_epoch, before_epoch);
    }
    e->cv.notify_one();
  }
}

}  // namespace jbps
