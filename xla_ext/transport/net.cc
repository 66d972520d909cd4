#include "transport/net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "common/steady_clock.h"

namespace jbps {
namespace {

using Clock = std::chrono::steady_clock;
// RecvAll's wake-up threshold (SO_RCVLOWAT) for large reads: at most this
// much at once, and only for reads of at least kMinLowatBytes left.
constexpr size_t kWakeBytes = 256 << 10;
constexpr int kMinLowatBytes = 16 << 10;

int MsLeft(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left);
}

// Waits until fd is ready for `events`; returns kOk, kTimeout or kError.
IoStatus WaitFd(int fd, short events, int timeout_ms) {
  struct pollfd p = {fd, events, 0};
  for (;;) {
    int rc = ::poll(&p, 1, timeout_ms);
    if (rc > 0) return IoStatus::kOk;  // readiness or error: the next syscall tells which
    if (rc == 0) return IoStatus::kTimeout;
    if (errno != EINTR) return IoStatus::kError;
  }
}

bool Resolve(const HostPort& addr, struct addrinfo** res, bool passive, std::string* err) {
  struct addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  std::string port = std::to_string(addr.port);
  int rc = ::getaddrinfo(addr.host.empty() ? nullptr : addr.host.c_str(), port.c_str(), &hints, res);
  if (rc != 0) {
    *err = "cannot resolve " + addr.ToString() + ": " + gai_strerror(rc);
    return false;
  }
  return true;
}

}  // namespace

bool ParseHostPort(const std::string& text, HostPort* out, std::string* err) {
  std::string host;
  std::string port;
  if (!text.empty() && text[0] == '[') {
    auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      *err = "bad address '" + text + "' (expected [v6addr]:port)";
      return false;
    }
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    auto colon = text.rfind(':');
    if (colon == std::string::npos) {
      *err = "bad address '" + text + "' (expected host:port)";
      return false;
    }
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (host.empty()) {
    *err = "no host in address '" + text + "' (127.0.0.1 for this machine only, 0.0.0.0 for every interface)";
    return false;
  }
  char* end = nullptr;
  long p = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || p < 0 || p > 65535) {
    *err = "bad port in address '" + text + "'";
    return false;
  }
  out->host = host;
  out->port = static_cast<int>(p);
  return true;
}

void TuneSocket(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
}

// Half the psum timeout: a server that loses a worker tells the other workers,
// naming it, before their own psum timeout fires with a vaguer message.
static int ProbeSeconds(double timeout_s) { return std::max(1, static_cast<int>(timeout_s / 8)); }

int LivenessBoundSeconds(double timeout_s) { return 4 * ProbeSeconds(timeout_s); }

void SetLiveness(int fd, double timeout_s) {
  const int probe_s = ProbeSeconds(timeout_s);
  const int count = 3;
  const unsigned user_timeout_ms = static_cast<unsigned>(LivenessBoundSeconds(timeout_s)) * 1000u;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &probe_s, sizeof(probe_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &probe_s, sizeof(probe_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

int ConnectWithRetry(const HostPort& addr, double timeout_s, std::string* err) {
  auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  int backoff_ms = 20;
  std::string last = "timed out";
  for (;;) {
    struct addrinfo* res = nullptr;
    if (!Resolve(addr, &res, false, err)) return -1;
    for (struct addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
      int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) {
        last = std::strerror(errno);
        continue;
      }
      // Non-blocking connect so the deadline bounds it, then back to blocking.
      int flags = ::fcntl(fd, F_GETFL, 0);
      ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
      int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        if (WaitFd(fd, POLLOUT, MsLeft(deadline)) == IoStatus::kOk) {
          int soerr = 0;
          socklen_t len = sizeof(soerr);
          ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
          rc = soerr == 0 ? 0 : -1;
          errno = soerr;
        } else {
          errno = ETIMEDOUT;
        }
      }
      if (rc == 0) {
        ::fcntl(fd, F_SETFL, flags);
        TuneSocket(fd);
        ::freeaddrinfo(res);
        return fd;
      }
      last = std::strerror(errno);
      ::close(fd);
    }
    ::freeaddrinfo(res);
    if (MsLeft(deadline) == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(backoff_ms, MsLeft(deadline))));
    backoff_ms = std::min(backoff_ms * 2, 500);
  }
  *err = "cannot connect to " + addr.ToString() + " within " + std::to_string(timeout_s) + " s: " + last;
  return -1;
}

int Listen(const HostPort& addr, int* bound_port, std::string* err) {
  struct addrinfo* res = nullptr;
  if (!Resolve(addr, &res, true, err)) return -1;
  int fd = -1;
  std::string last;
  for (struct addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 128) == 0) break;
    last = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  if (fd < 0) {
    *err = "cannot listen on " + addr.ToString() + ": " + last;
    return -1;
  }
  struct sockaddr_storage ss;
  socklen_t len = sizeof(ss);
  ::getsockname(fd, reinterpret_cast<struct sockaddr*>(&ss), &len);
  *bound_port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<struct sockaddr_in6*>(&ss)->sin6_port)
                                         : ntohs(reinterpret_cast<struct sockaddr_in*>(&ss)->sin_port);
  return fd;
}

IoStatus RecvAll(int fd, void* buf, size_t n, int timeout_ms, int stall_timeout_ms) {
  char* p = static_cast<char*>(buf);
  size_t got = 0;
  int lowat = 1;  // the socket's SO_RCVLOWAT while we wait; 1 (the default) between reads
  IoStatus status = IoStatus::kOk;
  while (got < n) {
    // Read first, wait only when nothing is there: bytes usually are, and
    // every poll saved is a syscall per message.
    ssize_t r = ::recv(fd, p + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r == 0) {
      status = IoStatus::kClosed;
      break;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      // A large read wakes once a good part of it is there, not once per
      // packet: on a slow link a chunk arrives a segment at a time.
      // Never more than what is left: a threshold set for an earlier, larger
      // remainder would never be reached, and the read would stall.
      int want = static_cast<int>(std::min<size_t>(n - got, kWakeBytes));
      if (want < kMinLowatBytes) want = 1;
      if (want != lowat && ::setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(want)) == 0) lowat = want;
      status = WaitFd(fd, POLLIN, got == 0 ? timeout_ms : stall_timeout_ms);
      if (status != IoStatus::kOk) break;
    } else if (errno != EINTR) {
      status = errno == ECONNRESET ? IoStatus::kClosed : IoStatus::kError;
      break;
    }
  }
  if (lowat != 1) {
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof(one));
  }
  return status;
}

bool SpinUntilReadable(int fd, int64_t until_ns) {
  struct pollfd p = {fd, POLLIN, 0};
  for (;;) {
    if (::poll(&p, 1, 0) > 0) return true;  // readable, or an error the next read reports
    if (SteadyNs() >= until_ns) return false;
    ::sched_yield();
  }
}

IoStatus SendAll(int fd, struct iovec* iov, int iovcnt, int timeout_ms) {
  while (iovcnt > 0) {
    struct msghdr msg;
    std::memset(&msg, 0, sizeof(msg));
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(iovcnt);
    ssize_t w = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        IoStatus s = WaitFd(fd, POLLOUT, timeout_ms);
        if (s != IoStatus::kOk) return s;
        continue;
      }
      return (errno == EPIPE || errno == ECONNRESET) ? IoStatus::kClosed : IoStatus::kError;
    }
    size_t left = static_cast<size_t>(w);
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return IoStatus::kOk;
}

const char* IoStatusName(IoStatus s) {
  switch (s) {
    case IoStatus::kOk: return "ok";
    case IoStatus::kClosed: return "connection closed by peer";
    case IoStatus::kTimeout: return "timed out";
    case IoStatus::kError: return "socket error";
  }
  return "?";
}

std::string PeerName(int fd) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof(ss);
  if (::getpeername(fd, reinterpret_cast<struct sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<struct sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  } else {
    auto* a = reinterpret_cast<struct sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

void ShutdownFd(int fd) {
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
}

void CloseFd(int fd) {
  if (fd >= 0) ::close(fd);
}

}  // namespace jbps
