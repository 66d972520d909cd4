// Chunking: the keys chunks travel under, the check of a call's chunk table
// (the plan in jbps/partition/ cuts), and the fusion of small chunks bound
// for one server into one message. Every worker computes the same.
#include "engine/engine_impl.h"

namespace jbps {

uint64_t TreeDigest(std::string_view tree) {
  uint64_t h = SplitMix64(tree.size());
  size_t i = 0;
  for (; i + 8 <= tree.size(); i += 8) {
    uint64_t word;
    std::memcpy(&word, tree.data() + i, 8);
    h = SplitMix64(h ^ word);
  }
  uint64_t tail = 0;
  std::memcpy(&tail, tree.data() + i, tree.size() - i);
  return SplitMix64(h ^ tail);
}

uint64_t ChunkKey(uint64_t base_key, uint32_t shard, uint32_t chunk) {
  uint64_t k = SplitMix64(base_key ^ SplitMix64((static_cast<uint64_t>(shard) << 32) | chunk));
  return k == 0 ? 1 : k;  // key 0 marks connection-level errors on the wire
}

std::vector<int32_t> DealChunks(const CallSpec& spec, const std::vector<double>& fractions) {
  std::vector<int64_t> priority;  // of each chunk's operand
  for (size_t i = 0; i < spec.operands.size(); ++i)
    priority.insert(priority.end(), spec.chunk_counts[i], spec.operands[i].priority);
  std::vector<size_t> order(priority.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return priority[a] > priority[b]; });
  const size_t count = fractions.size();
  // Equal deficits go to a server that depends on the psum, so that many
  // one-chunk calls do not all start on server 0.
  const size_t rotation = count ? (spec.operands.empty() ? 0 : SplitMix64(spec.tree_key) % count) : 0;
  std::vector<double> assigned(count, 0.0);
  std::vector<int32_t> owner(priority.size(), 0);
  double dealt = 0;
  for (size_t i : order) {
    dealt += static_cast<double>(spec.chunk_bytes[i]);
    size_t best = 0;
    double best_deficit = -1e300;
    for (size_t k = 0; k < count; ++k) {
      const size_t s = (rotation + k) % count;
      const double deficit = fractions[s] * dealt - assigned[s];
      if (fractions[s] > 0 && deficit > best_deficit) {
        best = s;
        best_deficit = deficit;
      }
    }
    owner[i] = static_cast<int32_t>(best);
    assigned[best] += static_cast<double>(spec.chunk_bytes[i]);
  }
  return owner;
}

std::string Engine::CheckChunkTable(const CallSpec& spec) {
  const size_t ops = spec.operands.size();
  if (spec.chunk_counts.size() != ops)
    return "the chunk table has counts for " + std::to_string(spec.chunk_counts.size()) + " tensors, the call " +
           std::to_string(ops);
  if (spec.chunk_alone.size() != spec.chunk_bytes.size())
    return "the chunk table marks " + std::to_string(spec.chunk_alone.size()) + " chunks, it cuts " +
           std::to_string(spec.chunk_bytes.size());
  size_t next = 0;
  for (size_t i = 0; i < ops; ++i) {
    const Operand& op = spec.operands[i];
    const uint32_t n = spec.chunk_counts[i];
    if (next + n > spec.chunk_bytes.size())
      return "the chunk table cuts " + std::to_string(spec.chunk_bytes.size()) + " chunks, fewer than its counts";
    const size_t elem = DTypeSize(op.dtype, op.param);
    uint64_t total = 0;
    for (uint32_t c = 0; c < n; ++c) {
      const uint64_t b = spec.chunk_bytes[next + c];
      if (b == 0 || b % elem != 0)
        return "chunk " + std::to_string(c) + " of tensor " + std::to_string(i) + " has " + std::to_string(b) +
               " bytes, not a positive multiple of its " + std::to_string(elem) + "-byte elements";
      total += b;
    }
    if (total != op.nbytes)
      return "the chunks of tensor " + std::to_string(i) + " add up to " + std::to_string(total) +
             " bytes, its shard has " + std::to_string(op.nbytes);
    next += n;
  }
  if (next != spec.chunk_bytes.size())
    return "the chunk table cuts " + std::to_string(spec.chunk_bytes.size()) + " chunks, its counts " +
           std::to_string(next);
  if (spec.servers.size() != next)
    return "the plan routes " + std::to_string(spec.servers.size()) + " chunks, its table cuts " + std::to_string(next);
  return {};
}

// Small chunks bound for one server travel as one message: per message a
// header, an ack, a sum and a wake-up on each side would otherwise dominate
// a tree of many small tensors. Chunks are taken in dispatch order (priority,
// then position); each server has one open group, which takes a small chunk
// of its dtype (and parameter) while the group stays within a partition. Every worker runs
// the same plan, so every worker fuses the same chunks under the same key.
std::vector<ChunkPtr> FuseSmallChunks(std::vector<ChunkPtr> chunks, size_t partition, uint32_t shard,
                                      uint64_t* fused_out) {
  const size_t small = partition / kSmallChunkDivisor;
  std::vector<size_t> order(chunks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return chunks[a]->priority > chunks[b]->priority; });
  std::map<int, ChunkPtr> open;  // server -> its group (the first member, growing)
  std::vector<bool> absorbed(chunks.size(), false);
  uint64_t fused = 0;
  for (size_t i : order) {
    ChunkPtr& ch = chunks[i];
    if (ch->nbytes > small || ch->alone) continue;  // a ramp piece is small to go sooner
    auto it = open.find(ch->server);
    if (it != open.end()) {
      ChunkPtr& g = it->second;
      if (g->dtype == ch->dtype && g->param == ch->param && g->nbytes + ch->nbytes <= partition &&
          g->parts.size() < kMaxFusedParts) {
        g->parts.insert(g->parts.end(), ch->parts.begin(), ch->parts.end());
        g->nbytes += ch->nbytes;
        // A fused chunk's own key names every member, in order (0 marks connection-level errors).
        g->key = SplitMix64(g->key ^ ChunkKey(ch->key, shard, 0xffffffffu));
        if (g->key == 0) g->key = 1;
        absorbed[i] = true;
        ++fused;
        continue;
      }
    }
    open[ch->server] = ch;  // a new group starts with this chunk
  }
  *fused_out = fused;
  if (fused == 0) return chunks;
  std::vector<ChunkPtr> out;
  out.reserve(chunks.size() - fused);
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (!absorbed[i]) out.push_back(std::move(chunks[i]));
  }
  return out;
}

}  // namespace jbps
