// Blocking TCP helpers with explicit timeouts. Threads block in the kernel
// (poll/recv/sendmsg), never in busy loops; another thread wakes a blocked
// reader by shutting the socket down.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace jbps {

struct HostPort {
  std::string host;
  int port = 0;
  std::string ToString() const { return host + ":" + std::to_string(port); }
};

// Parses "host:port" ("[v6]:port" too). Returns false and sets *err on failure.
// The host must be given: listening on every interface takes an explicit 0.0.0.0.
bool ParseHostPort(const std::string& text, HostPort* out, std::string* err);

// Connects, retrying refused connections until the deadline (the peer may
// still be starting). Returns the fd or -1 with *err set.
int ConnectWithRetry(const HostPort& addr, double timeout_s, std::string* err);

// Binds and listens; *bound_port receives the port (useful with port 0).
int Listen(const HostPort& addr, int* bound_port, std::string* err);

// Low-latency, large-transfer options for data sockets.
void TuneSocket(int fd);

// Liveness of a peer whose host may vanish without closing the connection
// (power loss, network cut): TCP keepalive probes an idle connection every
// max(1, timeout_s / 8) s and gives up after 3 unanswered probes, and sent
// data unacknowledged as long fails too (TCP_USER_TIMEOUT). A dead host is
// thus noticed within max(4 s, timeout_s / 2), before a psum timeout; a killed
// process on a live host at once (its kernel closes the connection).
void SetLiveness(int fd, double timeout_s);
// The bound SetLiveness gives, in seconds.
int LivenessBoundSeconds(double timeout_s);

enum class IoStatus { kOk, kClosed, kTimeout, kError };

// Receives exactly n bytes. timeout_ms < 0 waits for the first byte without a
// bound (an idle connection), but once a message has started every further
// wait is bounded by `stall_timeout_ms` so a half-sent frame cannot hang us.
IoStatus RecvAll(int fd, void* buf, size_t n, int timeout_ms, int stall_timeout_ms);

// Polls fd without sleeping (yielding the CPU to any other runnable thread
// between polls) until it has bytes to read or SteadyNs() reaches until_ns;
// true when it has. For an answer due within microseconds, where sleeping
// and being woken cost more than the wait.
bool SpinUntilReadable(int fd, int64_t until_ns);

// Sends all bytes of the iovecs (header + payload in one syscall when possible).
// Waits at most timeout_ms for the peer to make progress.
IoStatus SendAll(int fd, struct iovec* iov, int iovcnt, int timeout_ms);

const char* IoStatusName(IoStatus s);

// "host:port" of the socket's peer, for log lines.
std::string PeerName(int fd);

// Wakes any thread blocked on fd and stops further I/O; the fd stays open
// until CloseFd so it cannot be reused under a running thread.
void ShutdownFd(int fd);
void CloseFd(int fd);

}  // namespace jbps
