#include "wire/frame.h"

#include <algorithm>

#include "common/steady_clock.h"

namespace jbps {

FrameHeader HelloFrame(uint64_t token, uint32_t rank, uint32_t num_workers) {
  FrameHeader h = MakeHeader(MsgType::kHello, token);
  h.sender = rank;
  h.key = num_workers;
  return h;
}

FrameHeader HelloOkFrame(uint64_t token, ServerRole role, uint64_t instance) {
  FrameHeader h = MakeHeader(MsgType::kHelloOk, token);
  h.key = static_cast<uint64_t>(role);
  h.sender = static_cast<uint32_t>(instance);
  h.round = static_cast<uint32_t>(instance >> 32);
  return h;
}

uint64_t HelloOkInstance(const FrameHeader& h) { return (static_cast<uint64_t>(h.round) << 32) | h.sender; }

FrameHeader ShmOfferFrame(uint64_t token, uint32_t rank, uint64_t slot_bytes) {
  FrameHeader h = MakeHeader(MsgType::kShmOffer, token);
  h.sender = rank;
  h.key = slot_bytes;
  return h;
}

FrameHeader RoundFrame(MsgType type, uint64_t token, uint64_t key, uint32_t round) {
  FrameHeader h = MakeHeader(type, token);
  h.key = key;
  h.round = round;
  return h;
}

FrameStatus FrameReader::Next(Frame* f, std::string* why, bool stamp) {
  IoStatus st = RecvAll(fd_, &f->header, sizeof(f->header), -1, stall_ms_);
  if (st != IoStatus::kOk) {
    *why = IoStatusName(st);
    return st == IoStatus::kClosed ? FrameStatus::kClosed : FrameStatus::kFailed;
  }
  const FrameHeader& h = f->header;
  f->read_ns = stamp || (h.flags & kFlagTimed) ? SteadyNs() : 0;
  *why = ValidateHeader(h, token_);
  if (!why->empty()) return FrameStatus::kBadHeader;
  f->type = static_cast<MsgType>(h.type);
  f->payload = 0;
  f->text.clear();
  switch (f->type) {
    case MsgType::kPushShm:
    case MsgType::kSumShm:  // ValidateHeader: nbytes == sizeof(ShmRef)
      st = RecvAll(fd_, &f->shm, sizeof(f->shm), stall_ms_, stall_ms_);
      break;
    case MsgType::kError:
    case MsgType::kAbort:
    case MsgType::kBye:
    case MsgType::kStall:  // ValidateHeader: at most kMaxErrorBytes
      f->text.resize(h.nbytes);
      st = h.nbytes == 0 ? IoStatus::kOk : RecvAll(fd_, f->text.data(), f->text.size(), stall_ms_, stall_ms_);
      break;
    default:
      f->payload = h.nbytes;  // ValidateHeader: 0 on control messages
      break;
  }
  if (st != IoStatus::kOk) {
    *why = std::string("truncated message of type ") + std::to_string(h.type) + ": " + IoStatusName(st);
    return FrameStatus::kTruncated;
  }
  return FrameStatus::kOk;
}

IoStatus FrameReader::Read(void* dst, size_t n) { return RecvAll(fd_, dst, n, stall_ms_, stall_ms_); }

IoStatus FrameReader::Skip(uint64_t n) {
  scratch_.resize(std::min<uint64_t>(n, 1 << 20));
  while (n > 0) {
    size_t k = std::min<uint64_t>(n, scratch_.size());
    IoStatus st = RecvAll(fd_, scratch_.data(), k, stall_ms_, stall_ms_);
    if (st != IoStatus::kOk) return st;
    n -= k;
  }
  return IoStatus::kOk;
}

}  // namespace jbps
