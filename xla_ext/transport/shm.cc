#include "transport/shm.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace jbps {
namespace {

constexpr size_t kBlockAlign = 4096;  // page-aligned blocks: whole pages per sum, aligned vector loads

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

bool FillAddress(const std::string& name, struct sockaddr_un* addr, socklen_t* len) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof(addr->sun_path)) return false;
  // A leading NUL puts the name in the abstract namespace: no file to clean up.
  std::memcpy(addr->sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(struct sockaddr_un, sun_path) + 1 + name.size());
  return true;
}

bool WaitReady(int fd, short events, int timeout_ms) {
  struct pollfd p = {fd, events, 0};
  for (;;) {
    int rc = ::poll(&p, 1, timeout_ms);
    if (rc > 0) return true;
    if (rc == 0 || errno != EINTR) return false;
  }
}

}  // namespace

std::shared_ptr<SharedRegion> SharedRegion::Create(size_t size, const char* what, std::string* err) {
  int fd = ::memfd_create(what, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    *err = Errno("memfd_create");
    return nullptr;
  }
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0 ||
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    *err = Errno("sizing or sealing a shared region");
    ::close(fd);
    return nullptr;
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *err = Errno("mmap of a shared region");
    ::close(fd);
    return nullptr;
  }
  return std::shared_ptr<SharedRegion>(new SharedRegion(fd, static_cast<char*>(p), size));
}

std::shared_ptr<SharedRegion> SharedRegion::Attach(int fd, std::string* err) {
  struct stat st;
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    *err = "the shared region is not sealed against shrinking";
    ::close(fd);
    return nullptr;
  }
  if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
    *err = "the shared region is empty";
    ::close(fd);
    return nullptr;
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *err = Errno("mmap of a peer's shared region");
    ::close(fd);
    return nullptr;
  }
  return std::shared_ptr<SharedRegion>(new SharedRegion(fd, static_cast<char*>(p), size));
}

SharedRegion::~SharedRegion() {
  ::munmap(data_, size_);
  ::close(fd_);
}

Arena::Arena(std::shared_ptr<SharedRegion> region) : region_(std::move(region)) {
  free_[0] = region_->size() - region_->size() % kBlockAlign;
}

int64_t Arena::Allocate(size_t n) {
  if (n == 0) n = 1;
  const size_t len = (n + kBlockAlign - 1) / kBlockAlign * kBlockAlign;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < len) continue;
    const size_t offset = it->first;
    const size_t rest = it->second - len;
    free_.erase(it);
    if (rest > 0) free_[offset + len] = rest;
    used_[offset] = len;
    return static_cast<int64_t>(offset);
  }
  return -1;
}

void Arena::Free(int64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  auto u = used_.find(static_cast<size_t>(offset));
  if (u == used_.end()) return;
  size_t start = u->first, len = u->second;
  used_.erase(u);
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + len) {  // merge with the block after
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {  // and the one before
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      prev->second += len;
      return;
    }
  }
  free_[start] = len;
}

std::string ShmSocketName(uint64_t token, uint64_t instance) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "jbps-%016llx-%016llx", static_cast<unsigned long long>(token),
                static_cast<unsigned long long>(instance));
  return buf;
}

namespace {

// A SOCK_SEQPACKET socket bound and listening at, or connected to, the abstract name.
int OpenShmSocket(const std::string& name, bool listen, std::string* err) {
  struct sockaddr_un addr;
  socklen_t len;
  if (!FillAddress(name, &addr, &len)) {
    *err = "shared-memory socket name too long";
    return -1;
  }
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | (listen ? SOCK_NONBLOCK : 0), 0);
  if (fd < 0) {
    *err = Errno("unix socket");
    return -1;
  }
  const auto* sa = reinterpret_cast<struct sockaddr*>(&addr);
  // A listening abstract socket answers a connect at once or not at all (it is local).
  bool ok = listen ? ::bind(fd, sa, len) == 0 && ::listen(fd, 64) == 0 : ::connect(fd, sa, len) == 0;
  if (!ok) {
    *err = Errno(listen ? "binding the shared-memory socket @" + name : "no shared-memory socket @" + name);
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

int ListenShmSocket(const std::string& name, std::string* err) { return OpenShmSocket(name, true, err); }

int ConnectShmSocket(const std::string& name, std::string* err) { return OpenShmSocket(name, false, err); }

bool SendWithFd(int sock, const void* buf, size_t n, int fd, int timeout_ms) {
  struct iovec iov = {const_cast<void*>(buf), n};
  struct msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  for (;;) {
    if (!WaitReady(sock, POLLOUT, timeout_ms)) return false;
    ssize_t r = ::sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r == static_cast<ssize_t>(n)) return true;
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    return false;
  }
}

ssize_t RecvWithFd(int sock, void* buf, size_t n, int* fd, int timeout_ms) {
  *fd = -1;
  struct iovec iov = {buf, n};
  struct msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  for (;;) {
    if (!WaitReady(sock, POLLIN, timeout_ms)) return -1;
    ssize_t r = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    // Keep the first descriptor; close any others a hostile peer attached.
    for (struct cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int got;
        std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        if (*fd < 0) {
          *fd = got;
        } else {
          ::close(got);
        }
      }
    }
    if (r < 0 || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
      if (*fd >= 0) ::close(*fd);
      *fd = -1;
      return -1;
    }
    return r;
  }
}

}  // namespace jbps
