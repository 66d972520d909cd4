// JBPS_MULTIVERSION: compile a plain loop for three instruction sets at once
// (target_clones: baseline x86-64, x86-64-v3 = AVX2+F16C+FMA, x86-64-v4 =
// AVX-512F/BW/DQ/VL), picked at load time by the CPU's feature bits. Not
// arch=haswell/skylake-avx512: their resolver matches exact CPU models, and
// an Ice Lake Xeon ran the SSE2 default (sum_kernels.cc). Elsewhere: nothing.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JBPS_MULTIVERSION __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define JBPS_MULTIVERSION
#endif

// The one check behind every hand-written AVX2 kernel (the F16C casts, the
// streamed copy, onebit's signs and decode, topk's scans): read once, safe
// even from a static constructor (__builtin_cpu_init). avx2 also says the OS
// saves ymm state, which libgcc's f16c bit alone does not (GCC bug 105920).
// JBPS_CPU_BASELINE=1 turns them off, so the portable loops run (the tests
// compare both); JBPS_MULTIVERSION's loops still pick by the CPU.
#if defined(__x86_64__) && defined(__GNUC__)
#define JBPS_HAVE_CPU_CHECKS 1
#include <cstdlib>
#include <cstring>
namespace jbps {
inline bool CpuHasAvx2() {
  static const bool have = [] {
    const char* baseline = std::getenv("JBPS_CPU_BASELINE");
    if (baseline != nullptr && baseline[0] != '\0' && std::strcmp(baseline, "0") != 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return have;
}
inline bool CpuHasAvx2F16c() {
  static const bool have = CpuHasAvx2() && __builtin_cpu_supports("f16c");
  return have;
}
}  // namespace jbps
#endif
#ifndef JBPS_HAVE_CPU_CHECKS
namespace jbps {
inline bool CpuHasAvx2() { return false; }  // no hand-written AVX2 kernels here
}  // namespace jbps
#endif
