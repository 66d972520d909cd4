// Chunking: the keys chunks travel under, how big a chunk of a dtype is, and
// the fusion of small chunks bound for one server into one message. Every
// worker computes the same (the plan in jbps/partition/ does too).
#include "engine_impl.h"

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

size_t Engine::ChunkBytes(DType dtype, uint16_t param, size_t partition_bytes) {
  size_t elem = DTypeSize(dtype, param);
  return std::max(elem, partition_bytes - partition_bytes % elem);
}

size_t Engine::NumChunks(size_t nbytes, DType dtype, uint16_t param, size_t partition_bytes, bool ramp) {
  return ChunkLayout(nbytes, dtype, param, partition_bytes, ramp).count();
}

ChunkLayout::ChunkLayout(size_t nbytes, DType dtype, uint16_t param, size_t partition_bytes, bool ramp)
    : nbytes_(nbytes), part_(Engine::ChunkBytes(dtype, param, partition_bytes)) {
  // Compressed records are not cut below a partition: their blocks are the codec's.
  const bool plain = dtype != DType::kOneBit && dtype != DType::kTopK;
  ramped_ = ramp && plain && part_ % (8 * DTypeSize(dtype, param)) == 0 && nbytes >= kRampMinParts * part_;
  const size_t between = ramped_ ? nbytes - 2 * part_ : nbytes;
  middle_ = (between + part_ - 1) / part_;
}

size_t ChunkLayout::count() const { return middle_ + (ramped_ ? 2 * std::size(kRampEighths) : 0); }

void ChunkLayout::At(size_t c, size_t* offset, size_t* size) const {
  const size_t ramp = ramped_ ? std::size(kRampEighths) : 0;
  const size_t eighth = part_ / 8;
  if (c < ramp) {  // up: 1, 1, 2, 4 eighths of the first partition
    *offset = 0;
    for (size_t i = 0; i < c; ++i) *offset += kRampEighths[i] * eighth;
    *size = kRampEighths[c] * eighth;
    return;
  }
  if (c < ramp + middle_) {
    const size_t start = ramped_ ? part_ : 0;
    const size_t end = ramped_ ? nbytes_ - part_ : nbytes_;
    *offset = start + (c - ramp) * part_;
    *size = std::min(part_, end - *offset);
    return;
  }
  // Down: 4, 2, 1, 1 eighths of the last partition.
  const size_t j = c - ramp - middle_;
  *offset = nbytes_ - part_;
  for (size_t i = 0; i < j; ++i) *offset += kRampEighths[ramp - 1 - i] * eighth;
  *size = kRampEighths[ramp - 1 - j] * eighth;
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
    if (ch->nbytes > small || ch->ramp) continue;  // a ramp piece is small to go alone
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
