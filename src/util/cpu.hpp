// What this CPU can run, for code compiled for wider instruction sets than the build's baseline.
// Such code sits between KG_AVX512_BEGIN and KG_AVX512_END (GCC's target pragma) and is chosen at
// run time with cpu_has_avx512f(), so one library runs on every x86-64 machine. Clang ignores the
// pragma (its builds, such as the fuzz preset's, have no AVX-512 paths).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define KG_HAVE_AVX512_PATHS 1
#define KG_AVX512_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f\")")
#define KG_AVX512_END _Pragma("GCC pop_options")
#else
#define KG_HAVE_AVX512_PATHS 0
#endif

namespace kg::util {

// True when the CPU (and the operating system) run AVX-512F code.
inline bool cpu_has_avx512f() {
#if KG_HAVE_AVX512_PATHS
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
#else
  return false;
#endif
}

}  // namespace kg::util
