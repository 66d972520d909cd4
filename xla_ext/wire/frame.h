// The frame layer over protocol.h: builders for the messages whose header
// fields mean something of their own, and a reader that returns each frame's
// checked header with its small trailer (a ShmRef, or the text of an error,
// abort or goodbye), leaving the payload on the socket for the caller to
// read straight into its own buffers (a sum into XLA's) or to skip.
#pragma once

#include <cstdint>
#include <string>

#include "transport/net.h"
#include "wire/protocol.h"

namespace jbps {

// worker -> server, first: this worker's rank and the job's worker count.
FrameHeader HelloFrame(uint64_t token, uint32_t rank, uint32_t num_workers);
// server -> worker: the server's role, and its instance id (0: no shared
// memory offered), which names its shared-memory socket (shm.h).
FrameHeader HelloOkFrame(uint64_t token, ServerRole role, uint64_t instance);
uint64_t HelloOkInstance(const FrameHeader& h);
// worker -> server, on the shared-memory socket: its push slots' size.
FrameHeader ShmOfferFrame(uint64_t token, uint32_t rank, uint64_t slot_bytes);
// A message about one key's round (kPushAck, kRelease, kError, ...).
FrameHeader RoundFrame(MsgType type, uint64_t token, uint64_t key, uint32_t round);

// One frame as read: the header (checked by ValidateHeader), when it was read
// (SteadyNs; only when asked, or for a timed frame, else 0), its trailer, and
// how many payload bytes follow it.
struct Frame {
  FrameHeader header;
  MsgType type = MsgType::kHello;
  int64_t read_ns = 0;
  ShmRef shm;            // kPushShm, kSumShm
  std::string text;      // kError, kAbort, kBye
  uint64_t payload = 0;  // kPush, kSum, kTree: bytes that follow, for Read or Skip
};

enum class FrameStatus {
  kOk,
  kClosed,     // the peer closed the connection before a header began
  kFailed,     // the socket failed or stalled (why: IoStatusName)
  kBadHeader,  // the header is not a valid frame (why: ValidateHeader's reason)
  kTruncated,  // the header was read, its trailer did not arrive (frame->type says which)
};

class FrameReader {
 public:
  // stall_ms bounds every wait once a frame has begun.
  FrameReader(int fd, uint64_t token, int stall_ms) : fd_(fd), token_(token), stall_ms_(stall_ms) {}
  // The next frame, waiting for it to begin without a bound (an idle
  // connection; liveness probes watch it). Anything but kOk ends the
  // connection; *why says what failed. stamp: fill read_ns for every frame,
  // not only for those flagged kFlagTimed.
  FrameStatus Next(Frame* frame, std::string* why, bool stamp = false);
  // Payload bytes of the current frame, into dst / dropped.
  IoStatus Read(void* dst, size_t n);
  IoStatus Skip(uint64_t n);

 private:
  int fd_;
  uint64_t token_;
  int stall_ms_;
  std::string scratch_;
};

}  // namespace jbps
