// Shared memory between a worker and a summation server on the same host.
//
// A worker writes each push into a slot of its own region and sends the
// server only where it is; the server sums into blocks of its sum arena,
// which every colocated worker maps, and tells each worker where the sum is.
// Payload bytes then cross no socket and no kernel buffer: the transport's
// copies are the worker's copy in and copy out (XLA owns its buffers, so
// they cannot live in shared memory themselves).
//
// Regions are sealed memfds: they have no name, so nothing is left behind
// when a process exits or is killed, and the seals stop the owner from
// shrinking a region under a reader (which would fault). They travel as file
// descriptors over a Unix socket in the abstract namespace, named after the
// job's token and the server's random instance id ("jbps-<token>-<instance>",
// the id told in the hello reply): it too has no file, vanishes with the
// server, and is scoped to the network namespace,
// so a worker on another host (or in another namespace) cannot reach it and
// keeps using TCP. That failed connect is the whole chooser.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace jbps {

// A mapped, sealed memfd.
class SharedRegion {
 public:
  // A new zero-filled region of `size` bytes, mapped read-write.
  static std::shared_ptr<SharedRegion> Create(size_t size, const char* what, std::string* err);
  // Maps a region another process created, read-only (only its creator
  // writes it); takes ownership of fd. Refused unless the region is sealed
  // against shrinking.
  static std::shared_ptr<SharedRegion> Attach(int fd, std::string* err);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }
  // True when [offset, offset + n) lies inside the region (overflow-safe).
  bool Contains(uint64_t offset, uint64_t n) const { return offset <= size_ && n <= size_ - offset; }

 private:
  SharedRegion(int fd, char* data, size_t size) : fd_(fd), data_(data), size_(size) {}
  int fd_;
  char* data_;
  size_t size_;
};

// A first-fit allocator over a region, lowest address first, so the pages a
// job touches stay those of its peak use and are reused round after round.
class Arena {
 public:
  explicit Arena(std::shared_ptr<SharedRegion> region);
  // Offset of a new block of at least n bytes, or -1 when none fits.
  int64_t Allocate(size_t n);
  void Free(int64_t offset);
  const std::shared_ptr<SharedRegion>& region() const { return region_; }

 private:
  std::shared_ptr<SharedRegion> region_;
  mutable std::mutex mu_;
  std::map<size_t, size_t> free_;  // offset -> length, coalesced
  std::map<size_t, size_t> used_;  // offset -> length
};

// The name of a server's shared-memory socket: its job's token and its own
// instance id (random, sent in the hello reply), so no two servers share one.
std::string ShmSocketName(uint64_t token, uint64_t instance);
// A listening SOCK_SEQPACKET socket in the abstract namespace (non-blocking), or -1.
int ListenShmSocket(const std::string& name, std::string* err);
// Connected to a server's socket, or -1 (no such server in this namespace).
int ConnectShmSocket(const std::string& name, std::string* err);
// One message with an optional descriptor (fd < 0: none). Waits at most timeout_ms.
bool SendWithFd(int sock, const void* buf, size_t n, int fd, int timeout_ms);
// One message of at most n bytes and its descriptor, if any (*fd = -1 when
// none came). Returns the bytes received, or -1 on error or timeout.
ssize_t RecvWithFd(int sock, void* buf, size_t n, int* fd, int timeout_ms);

}  // namespace jbps
