// Names the calling thread (at most 15 characters), so top -H, perf and
// /proc/PID/task/*/comm tell jbps's threads apart.
#pragma once

#include <pthread.h>

namespace jbps {

inline void NameThisThread(const char* name) { pthread_setname_np(pthread_self(), name); }

}  // namespace jbps
