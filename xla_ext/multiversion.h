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
