// Warnings from C++ threads go to stderr with one write per line, so lines of
// concurrent threads do not interleave.
#pragma once

#include <unistd.h>

#include <cstdarg>
#include <cstdio>

namespace jbps {

__attribute__((format(printf, 1, 2))) inline void LogWarning(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = std::vsnprintf(buf, sizeof(buf) - 1, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if (n > static_cast<int>(sizeof(buf)) - 2) n = static_cast<int>(sizeof(buf)) - 2;
  buf[n++] = '\n';
  ssize_t ignored = ::write(2, buf, static_cast<size_t>(n));
  (void)ignored;
}

}  // namespace jbps
