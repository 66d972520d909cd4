// ShmTransport: pushes written into this worker's slots, sums read from the
// server's arena (transport/shm.h has the regions and their hand-over). The
// copy in and the copy out are the transport's only copies: XLA owns its
// buffers, so they cannot live in shared memory themselves.
#include <cstring>

#include "common/log.h"
#include "kernels/stream_copy.h"
#include "transport/shm.h"
#include "transport/transport.h"

namespace jbps {

std::unique_ptr<ShmTransport> ShmTransport::Attach(uint64_t token, uint64_t instance, uint32_t rank, size_t slots,
                                                   size_t slot_bytes, int timeout_ms, std::string* err) {
  int sock = ConnectShmSocket(ShmSocketName(token, instance), err);
  if (sock < 0) {  // no such server on this host: TCP, and nothing to warn about
    err->clear();
    return nullptr;
  }
  auto region = SharedRegion::Create(slots * slot_bytes, "jbps-push", err);
  std::shared_ptr<SharedRegion> arena;
  if (region) {
    FrameHeader offer = ShmOfferFrame(token, rank, slot_bytes);
    char reply_buf[sizeof(FrameHeader) + 1024];
    int fd = -1;
    ssize_t n = -1;
    if (SendWithFd(sock, &offer, sizeof(offer), region->fd(), timeout_ms))
      n = RecvWithFd(sock, reply_buf, sizeof(reply_buf), &fd, timeout_ms);
    FrameHeader reply;
    if (n >= static_cast<ssize_t>(sizeof(reply))) std::memcpy(&reply, reply_buf, sizeof(reply));
    if (n < static_cast<ssize_t>(sizeof(reply)) || !ValidateHeader(reply, token).empty()) {
      *err = "no valid answer to the offer";
    } else if (reply.type == static_cast<uint16_t>(MsgType::kError)) {
      *err = std::string(reply_buf + sizeof(reply), n - sizeof(reply));
    } else if (reply.type != static_cast<uint16_t>(MsgType::kShmAccept) || fd < 0) {
      *err = "unexpected answer to the offer";
    } else {
      arena = SharedRegion::Attach(fd, err);
      fd = -1;
    }
    if (fd >= 0) CloseFd(fd);
  }
  CloseFd(sock);
  if (!arena) return nullptr;
  auto t = std::unique_ptr<ShmTransport>(new ShmTransport());
  t->push_region_ = std::move(region);
  t->sum_region_ = std::move(arena);
  t->slots_ = slots;
  t->slot_bytes_ = slot_bytes;
  return t;
}

void ShmTransport::StagePush(int slot, const std::vector<Segment>& parts, size_t nbytes, FrameHeader* h, ShmRef* ref,
                             std::vector<struct iovec>* iov) const {
  if (slot < 0) return TcpTransport::StagePush(slot, parts, nbytes, h, ref, iov);
  ref->offset = static_cast<uint64_t>(slot) * slot_bytes_;
  ref->nbytes = nbytes;
  char* dst = push_region_->data() + ref->offset;
  for (const Segment& s : parts) {
    std::memcpy(dst, s.data, s.nbytes);
    dst += s.nbytes;
  }
  h->type = static_cast<uint16_t>(MsgType::kPushShm);
  h->nbytes = sizeof(*ref);
  iov->push_back({ref, sizeof(*ref)});
}

bool ShmTransport::CheckSum(const Frame& f, std::string* why) const {
  if (f.type == MsgType::kSumShm && !sum_region_->Contains(f.shm.offset, f.shm.nbytes)) {
    *why = "protocol error: a shared-memory sum outside the server's arena";
    return false;
  }
  return true;
}

bool ShmTransport::TakeSum(const Frame& f, FrameReader* reader, const std::vector<Destination>* out,
                           std::string* why) const {
  if (f.type != MsgType::kSumShm) return TcpTransport::TakeSum(f, reader, out, why);
  if (!CheckSum(f, why)) return false;
  if (out == nullptr) return true;
  const char* src = sum_region_->data() + f.shm.offset;
  for (const Destination& d : *out) {
    StreamCopy(d.data, src, d.nbytes);
    src += d.nbytes;
  }
  return true;
}

}  // namespace jbps
