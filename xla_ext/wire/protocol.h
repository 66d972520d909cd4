// The wire format between workers and summation servers.
//
// Every message is a fixed 48-byte header, optionally followed by `nbytes` of
// payload. Headers are checked field by field before any payload is read, so a
// bad length never makes the reader allocate or wait for it.
//
//   worker -> server  kHello    sender=rank, key=num_workers     (first message)
//   server -> worker  kHelloOk  key=role (ServerRole)            (or kError + close)
//   worker -> server  kPush     key, round, dtype, param, aux = tree digest, payload (a chunk of a shard)
//   server -> worker  kPushAck  key, round                       (payload received: frees a credit)
//   server -> worker  kSum      key, round, dtype, param, routes, payload (all workers pushed: the sum)
//   server -> worker  kError    key, round, payload = message    (this key/round failed)
//   worker -> server  kBye      payload = why the worker leaves:  empty for a clean end; else (an
//                               uncaught exception) the server ends the job naming the worker
//   worker -> server  kTree     key, round, payload = the call's tree digest (8 bytes), then its
//                               description (leaf paths, dtypes, shapes) unless this connection
//                               sent that description before (kMaxDescribedTrees); not answered
//                               when every worker sent the same digest, else answered by kError
//                               naming the first leaf that differs
//   server -> worker  kAbort    payload = why the job failed (a worker was lost); the server
//                               closes the connection after it
//   server -> worker  kStall    key, round, aux = ms waited, payload = which workers have not
//                               pushed that round ("worker 1 has"), sent once to the workers that
//                               have, when it has waited long (kStallNoteFraction of the
//                               timeout): their timeout then names the missing workers
//   worker -> server  kRoutes   key = a route epoch: this worker holds that epoch's split (a re-plan,
//                               jbps/replan.py). Every sum carries in `routes` the latest epoch all
//                               the job's workers have announced to its server when the round was
//                               summed; a worker routes a psum's next call by the epoch its last
//                               call's sums carried, so every worker switches at the same round
//
// With shared memory (shm.h; worker and server on one host):
//   worker -> server  kShmOffer  on the server's Unix socket, with the worker's push
//                                region's fd attached; sender=rank, key=slot bytes
//   server -> worker  kShmAccept on that socket, with the server's sum arena fd attached
//                                (or kError + message)
//   worker -> server  kPushShm   key, round, dtype, param, aux, payload = ShmRef into the worker's region;
//                                answered by kPushAck once taken into its round (a credit);
//                                the slot stays the server's, read in place, until that
//                                round's kSum/kSumShm or kError reaches the worker
//   server -> worker  kSumShm    key, round, dtype, param, routes, payload = ShmRef into the server's arena
//   worker -> server  kRelease   key, round: the worker has copied that sum out
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/dtype.h"

namespace jbps {

constexpr uint32_t kMagic = 0x5350424a;  // "JBPS" in little-endian bytes
// 2: the onebit dtype (5) on the wire; 3: the topk dtype (6); 4: a dtype's
// parameter (`param`: topk's values per record); 6: route epochs (kRoutes,
// FrameHeader::routes). A peer of another version is refused at the hello,
// naming both.
constexpr uint16_t kProtocolVersion = 6;
// Largest payload a header may announce. Chunks are at most the partition size
// (default 4 MiB); this bound only stops a hostile length from being trusted.
constexpr uint64_t kMaxPayloadBytes = uint64_t{1} << 31;
constexpr uint64_t kMaxErrorBytes = 64 * 1024;
// A call's tree description; longer ones are sent as a digest (jbps/ops/psum.py).
constexpr uint64_t kMaxTreeBytes = 1 << 20;
constexpr uint64_t kTreeDigestBytes = 8;  // before the description in a kTree payload
// The tree descriptions a server keeps per connection, so that a call sends
// its description once and only its digest after: the first ones a worker
// sends until either bound is reached (both ends count alike, so a worker
// knows which the server has); later ones travel with every check.
constexpr size_t kMaxDescribedTrees = 4096;
// A round that has waited this share of the server's timeout (at most
// kStallNoteMaxSeconds) for some workers' pushes is reported to the workers
// that pushed it (kStall), so that their timeout names the missing workers.
constexpr double kStallNoteFraction = 0.5;
constexpr double kStallNoteMaxSeconds = 5.0;
constexpr uint64_t kMaxDescribedTreeBytes = uint64_t{64} << 20;

// Where a server runs, which decides its share of the bytes (docs/design.md,
// "Sharing the bytes"): on a worker's machine, or on a CPU-only machine.
enum class ServerRole : uint8_t { kColocated = 0, kDedicated = 1 };

enum class MsgType : uint16_t {
  kHello = 1,
  kHelloOk = 2,
  kPush = 3,
  kPushAck = 4,
  kSum = 5,
  kError = 6,
  kBye = 7,
  kTree = 8,
  kAbort = 9,
  kPushShm = 10,
  kSumShm = 11,
  kRelease = 12,
  kShmOffer = 13,
  kShmAccept = 14,
  kStall = 15,
  kRoutes = 16,
};

// Where a payload lies in shared memory: the payload of kPushShm and kSumShm.
struct ShmRef {
  uint64_t offset = 0;
  uint64_t nbytes = 0;
};
static_assert(sizeof(ShmRef) == 16, "wire ShmRef must stay 16 bytes");

struct FrameHeader {
  uint32_t magic = kMagic;
  uint16_t version = kProtocolVersion;
  uint16_t type = 0;
  uint64_t token = 0;  // the job token: a frame without it is refused
  uint64_t key = 0;
  uint32_t round = 0;
  uint8_t dtype = 0;
  uint8_t flags = 0;  // kFlag* bits
  // The dtype's parameter on data messages (dtype.h): for topk the values each
  // record keeps, 1 to kTopKMaxKeep, which sizes its records (the workers'
  // choice, compression="topk:FRACTION"); 0 for other dtypes and messages. A
  // round whose pushes differ in it fails as one whose dtypes differ.
  uint16_t param = 0;
  uint32_t sender = 0;  // worker rank; on a timed sum, see kFlagTimed
  uint32_t aux = 0;     // see kFlagTimed
  uint32_t nbytes = 0;  // payload bytes that follow (at most kMaxPayloadBytes)
  uint32_t routes = 0;  // on a sum: the route epoch every worker had announced (kRoutes)
};
static_assert(sizeof(FrameHeader) == 48, "wire header must stay 48 bytes");

// A push with kFlagTimed asks its server to time the round (the benchmark's
// latency breakdown): the round's sum then carries kFlagTimed, with `aux` the
// server's time from the round's last push read to the sum written, and
// `sender` this worker's wait on the server for the other workers' pushes
// (from its push read to the last one read), both in units of 100 ns.
constexpr uint8_t kFlagTimed = 1;
constexpr uint64_t kTimedUnitNs = 100;
// Data pushes carry the low 32 bits of their call's tree digest in `aux`: a
// round whose pushes disagree fails with a kError carrying this flag, and no
// sum. The worker then waits for the tree check's error, which names the leaf.
constexpr uint8_t kFlagTreeMismatch = 2;

// One sum on a server: a key in one round. Rounds keep a fast worker's next
// step apart from a slow worker's current one.
struct RoundKey {
  uint64_t key;
  uint32_t round;
  bool operator==(const RoundKey& o) const { return key == o.key && round == o.round; }
};
struct RoundKeyHash {
  size_t operator()(const RoundKey& k) const { return k.key * 31 + k.round; }
};

inline FrameHeader MakeHeader(MsgType type, uint64_t token) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(type);
  h.token = token;
  return h;
}

// Checks what can be checked without context; returns an empty string when
// the header is well formed, otherwise why not.
inline std::string ValidateHeader(const FrameHeader& h, uint64_t token) {
  if (h.magic != kMagic) return "bad magic (not a jbps peer)";
  if (h.version != kProtocolVersion)
    return "protocol version " + std::to_string(h.version) + ", expected " + std::to_string(kProtocolVersion);
  if (h.token != token) return "wrong job token";
  if (h.type < static_cast<uint16_t>(MsgType::kHello) || h.type > static_cast<uint16_t>(MsgType::kRoutes))
    return "unknown message type " + std::to_string(h.type);
  const bool carries_data =
      h.type == static_cast<uint16_t>(MsgType::kPush) || h.type == static_cast<uint16_t>(MsgType::kSum);
  const bool refers_to_shm =
      h.type == static_cast<uint16_t>(MsgType::kPushShm) || h.type == static_cast<uint16_t>(MsgType::kSumShm);
  if (carries_data || refers_to_shm) {
    if (!DTypeValid(h.dtype)) return "unknown dtype code " + std::to_string(h.dtype);
    const DType dtype = static_cast<DType>(h.dtype);
    if (!DTypeParamValid(dtype, h.param))
      return "parameter " + std::to_string(h.param) + " out of range for dtype " + DTypeName(dtype);
    if (refers_to_shm) {
      if (h.nbytes != sizeof(ShmRef)) return "shared-memory reference of the wrong length";
    } else {
      if (h.nbytes > kMaxPayloadBytes) return "payload length " + std::to_string(h.nbytes) + " too large";
      if (h.nbytes % DTypeSize(dtype, h.param) != 0) return "payload length not a multiple of the element size";
    }
  } else if (h.type == static_cast<uint16_t>(MsgType::kError) || h.type == static_cast<uint16_t>(MsgType::kAbort) ||
             h.type == static_cast<uint16_t>(MsgType::kBye) || h.type == static_cast<uint16_t>(MsgType::kStall)) {
    if (h.nbytes > kMaxErrorBytes) return "error message too long";
  } else if (h.type == static_cast<uint16_t>(MsgType::kTree)) {
    if (h.nbytes < kTreeDigestBytes || h.nbytes > kTreeDigestBytes + kMaxTreeBytes)
      return "tree check length " + std::to_string(h.nbytes) + " out of range";
  } else if (h.nbytes != 0) {
    return "unexpected payload on a control message";
  }
  return {};
}

}  // namespace jbps
