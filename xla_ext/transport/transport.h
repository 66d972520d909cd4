// How a worker's pushes and its server's sums travel on one connection (as
// gloo's pair or ps-lite's Van): the socket carries every message, and the
// transport decides where a push's and a sum's bytes are. TcpTransport puts
// them on the socket after their header; ShmTransport (a server on this host)
// copies a push into a slot of a region both processes map and sends only
// where it lies, and reads a sum out of the server's arena the same way. The
// engine (engine/engine_link.cc) calls these and nothing below them.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/net.h"
#include "transport/shm.h"
#include "wire/frame.h"
#include "wire/protocol.h"

namespace jbps {

// Where a push's bytes come from, piece by piece (a fused chunk has several).
struct Segment {
  const void* data;
  size_t nbytes;
};
// Where a sum's bytes go, piece by piece.
struct Destination {
  void* data;
  size_t nbytes;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // Slots a push can be held in, outside the socket, and their size (0: none).
  virtual size_t slots() const { return 0; }
  virtual size_t slot_bytes() const { return 0; }
  // A push of `parts` (`nbytes` in all) under the header `h`: sets its type and
  // length and appends what follows the header on the socket to `iov`. `slot`
  // is the slot the engine gave it (-1: none, it goes on the socket); `ref`
  // holds what travels instead of the bytes, and must live until `iov` is sent.
  virtual void StagePush(int slot, const std::vector<Segment>& parts, size_t nbytes, FrameHeader* h, ShmRef* ref,
                         std::vector<struct iovec>* iov) const = 0;
  // Whether the sum frame `f` can be taken (its bytes lie where this transport
  // reads them), before anything else is done with it; else *why.
  virtual bool CheckSum(const Frame& f, std::string* why) const {
    (void)f;
    (void)why;
    return true;
  }
  // The bytes of the sum `f` announces, into `out` (null: not wanted, dropped);
  // `reader` is the connection's, positioned after the frame's header. False,
  // with *why, when the connection cannot go on.
  virtual bool TakeSum(const Frame& f, FrameReader* reader, const std::vector<Destination>* out,
                       std::string* why) const = 0;
  // Bytes of a sum frame: what `out` must hold.
  static uint64_t SumBytes(const Frame& f) { return f.type == MsgType::kSumShm ? f.shm.nbytes : f.payload; }
};

class TcpTransport : public Transport {
 public:
  const char* name() const override { return "tcp"; }
  void StagePush(int slot, const std::vector<Segment>& parts, size_t nbytes, FrameHeader* h, ShmRef* ref,
                 std::vector<struct iovec>* iov) const override;
  bool TakeSum(const Frame& f, FrameReader* reader, const std::vector<Destination>* out,
               std::string* why) const override;
};

// Shared memory with a server on this host (transport/shm.h); a push without
// a slot, and any TCP sum, still travel as TcpTransport's do.
class ShmTransport : public TcpTransport {
 public:
  // Offers the server (its shared-memory socket, named by the job's token and
  // the server's instance id) a region of `slots` push slots of `slot_bytes`,
  // and maps the server's sum arena in return. Null when that fails: with
  // *err empty when the server has no socket here (on another host, or in
  // another network namespace), else saying why.
  static std::unique_ptr<ShmTransport> Attach(uint64_t token, uint64_t instance, uint32_t rank, size_t slots,
                                              size_t slot_bytes, int timeout_ms, std::string* err);
  const char* name() const override { return "shm"; }
  size_t slots() const override { return slots_; }
  size_t slot_bytes() const override { return slot_bytes_; }
  void StagePush(int slot, const std::vector<Segment>& parts, size_t nbytes, FrameHeader* h, ShmRef* ref,
                 std::vector<struct iovec>* iov) const override;
  bool CheckSum(const Frame& f, std::string* why) const override;
  bool TakeSum(const Frame& f, FrameReader* reader, const std::vector<Destination>* out,
               std::string* why) const override;

 private:
  std::shared_ptr<SharedRegion> push_region_;  // this worker's slots, written here
  std::shared_ptr<SharedRegion> sum_region_;   // the server's arena, read only
  size_t slots_ = 0;
  size_t slot_bytes_ = 0;
};

}  // namespace jbps
