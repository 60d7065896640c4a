// The CUDA emulation header: what a kernel source is compiled against when the host C++ compiler
// builds it for the CPU (kg_cuda_emu.h in the module's include folder). The host JIT includes it
// first, then the kernel source and the generated entry trampolines.
//
// This file is the text of that header, held as one raw string literal so the library carries it
// (host_jit.cpp includes this file inside an initializer). Everything between the markers is
// plain C++17 and is what a kernel sees:
//   - threadIdx, blockIdx, blockDim, gridDim: thread-locals of the OS thread running the
//     emulated thread's fiber, restored after every call that can switch fibers;
//   - __shared__ → static thread_local: the threads of a block run as fibers of one OS thread, one
//     block at a time, so a thread-local is exactly per-block storage (dynamic `extern __shared__`
//     arrays are rewritten by the JIT to a pointer to the block's dynamic shared memory);
//   - __syncthreads, warp shuffles, votes and __syncwarp call into the runtime, which blocks the
//     fiber until its partners arrive and checks the masks;
//   - atomics are the compiler's __atomic builtins (blocks run in parallel on worker threads);
//   - math functions, integer and conversion intrinsics, vector types, __half and __nv_bfloat16.
R"KG_CUDA_EMU(#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <type_traits>
#include <utility>

#include "kg_emu_abi.h"

#define KG_CUDA_EMU 1

// ---- qualifiers ----
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static thread_local
#define __grid_constant__

#define KG_EMU_EXPORT extern "C" __attribute__((visibility("default")))

// ---- vector types ----
#define KG_EMU_VEC(name, T, a2, a4)                                         \
  struct name##1 {                                                          \
    T x;                                                                    \
  };                                                                        \
  struct __attribute__((aligned(a2))) name##2 {                             \
    T x, y;                                                                 \
  };                                                                        \
  struct name##3 {                                                          \
    T x, y, z;                                                              \
  };                                                                        \
  struct __attribute__((aligned(a4))) name##4 {                             \
    T x, y, z, w;                                                           \
  };                                                                        \
  static inline name##1 make_##name##1(T x) { return {x}; }                 \
  static inline name##2 make_##name##2(T x, T y) { return {x, y}; }         \
  static inline name##3 make_##name##3(T x, T y, T z) { return {x, y, z}; } \
  static inline name##4 make_##name##4(T x, T y, T z, T w) { return {x, y, z, w}; }
KG_EMU_VEC(char, signed char, 2, 4)
KG_EMU_VEC(uchar, unsigned char, 2, 4)
KG_EMU_VEC(short, short, 4, 8)
KG_EMU_VEC(ushort, unsigned short, 4, 8)
KG_EMU_VEC(int, int, 8, 16)
KG_EMU_VEC(uint, unsigned, 8, 16)
KG_EMU_VEC(long, long, 16, 16)
KG_EMU_VEC(ulong, unsigned long, 16, 16)
KG_EMU_VEC(longlong, long long, 16, 16)
KG_EMU_VEC(ulonglong, unsigned long long, 16, 16)
KG_EMU_VEC(float, float, 8, 16)
KG_EMU_VEC(double, double, 16, 16)
#undef KG_EMU_VEC

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

static constexpr int warpSize = 32;

// ---- the emulated thread ----
static const KgEmuApi* kg_emu_api_ = nullptr;
static thread_local const KgEmuThreadInfo* kg_emu_self_ = nullptr;
static thread_local uint3 threadIdx;
static thread_local uint3 blockIdx;
static thread_local dim3 blockDim;
static thread_local dim3 gridDim;
static thread_local unsigned char* kg_emu_dynamic_shared_ = nullptr;
// Raises the alignment of the module's TLS segment to 64 bytes (kept by `used` when nothing reads
// it). A dlopen'ed module's thread-locals live in a dynamic TLS block that glibc (>= 2.25)
// allocates with malloc per OS thread; with an alignment above 16 it rounds the block up to it.
// The __tls_get_addr interceptor of GCC 12's sanitizer runtime takes a block starting 16 bytes
// into a page for a glibc 2.19 one and reads the 16 bytes before it (under ASan: the heap chunk
// header) as its address and size; LeakSanitizer then scans that bogus range and crashes. A
// 64-byte-aligned block never starts there (docs/hardening.md, "Sanitizers").
static thread_local unsigned char kg_emu_tls_align_ __attribute__((used, aligned(64)));

// Makes `t` the running thread of this OS thread: called when its fiber starts and after every
// call that may have run other fibers.
static inline void kg_emu_enter(const KgEmuThreadInfo* t) {
  kg_emu_self_ = t;
  threadIdx = uint3{t->thread_idx.x, t->thread_idx.y, t->thread_idx.z};
  blockIdx = uint3{t->block_idx.x, t->block_idx.y, t->block_idx.z};
  blockDim = dim3(t->block_dim.x, t->block_dim.y, t->block_dim.z);
  gridDim = dim3(t->grid_dim.x, t->grid_dim.y, t->grid_dim.z);
  kg_emu_dynamic_shared_ = t->dynamic_shared;
}
static inline unsigned char* kg_emu_dynamic_shared() { return kg_emu_dynamic_shared_; }

// ---- barriers, warps ----
static inline int kg_emu_barrier(int op, int pred) {
  const KgEmuThreadInfo* t = kg_emu_self_;
  const int r = kg_emu_api_->barrier(t, op, pred);
  kg_emu_enter(t);
  return r;
}
static inline void __syncthreads() { kg_emu_barrier(KG_EMU_BAR_SYNC, 0); }
static inline int __syncthreads_count(int p) { return kg_emu_barrier(KG_EMU_BAR_COUNT, p); }
static inline int __syncthreads_and(int p) { return kg_emu_barrier(KG_EMU_BAR_AND, p); }
static inline int __syncthreads_or(int p) { return kg_emu_barrier(KG_EMU_BAR_OR, p); }

static inline unsigned long long kg_emu_warp(int op, unsigned mask, unsigned long long v, int arg,
                                             int width) {
  const KgEmuThreadInfo* t = kg_emu_self_;
  const unsigned long long r = kg_emu_api_->warp(t, op, mask, v, arg, width);
  kg_emu_enter(t);
  return r;
}
template <class T>
static inline unsigned long long kg_emu_bits(const T& v) {
  static_assert(sizeof(T) <= 8, "warp shuffles move at most 8 bytes");
  unsigned long long b = 0;
  __builtin_memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
static inline T kg_emu_from_bits(unsigned long long b) {
  T v;
  __builtin_memcpy(&v, &b, sizeof(T));
  return v;
}
template <class T>
static inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  return kg_emu_from_bits<T>(kg_emu_warp(KG_EMU_SHFL_IDX, mask, kg_emu_bits(var), src_lane, width));
}
template <class T>
static inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return kg_emu_from_bits<T>(kg_emu_warp(KG_EMU_SHFL_UP, mask, kg_emu_bits(var), (int)delta, width));
}
template <class T>
static inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return kg_emu_from_bits<T>(kg_emu_warp(KG_EMU_SHFL_DOWN, mask, kg_emu_bits(var), (int)delta, width));
}
template <class T>
static inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  return kg_emu_from_bits<T>(kg_emu_warp(KG_EMU_SHFL_XOR, mask, kg_emu_bits(var), lane_mask, width));
}
static inline int __all_sync(unsigned mask, int pred) {
  return (int)kg_emu_warp(KG_EMU_VOTE_ALL, mask, pred != 0, 0, 32);
}
static inline int __any_sync(unsigned mask, int pred) {
  return (int)kg_emu_warp(KG_EMU_VOTE_ANY, mask, pred != 0, 0, 32);
}
static inline unsigned __ballot_sync(unsigned mask, int pred) {
  return (unsigned)kg_emu_warp(KG_EMU_VOTE_BALLOT, mask, pred != 0, 0, 32);
}
static inline void __syncwarp(unsigned mask = 0xffffffffu) { kg_emu_warp(KG_EMU_SYNCWARP, mask, 0, 0, 32); }
template <class T>
static inline unsigned __match_any_sync(unsigned mask, T value) {
  return (unsigned)kg_emu_warp(KG_EMU_MATCH_ANY, mask, kg_emu_bits(value), 0, 32);
}
template <class T>
static inline unsigned __match_all_sync(unsigned mask, T value, int* pred) {
  const unsigned r = (unsigned)kg_emu_warp(KG_EMU_MATCH_ALL, mask, kg_emu_bits(value), 0, 32);
  *pred = r != 0;
  return r;
}
#define KG_EMU_REDUCE(name, T, op)                                               \
  static inline T name(unsigned mask, T value) {                                 \
    return (T)kg_emu_warp(op, mask, (unsigned long long)(unsigned)value, 0, 32); \
  }
KG_EMU_REDUCE(__reduce_add_sync, unsigned, KG_EMU_REDUCE_ADD)
KG_EMU_REDUCE(__reduce_add_sync, int, KG_EMU_REDUCE_ADD)
KG_EMU_REDUCE(__reduce_min_sync, unsigned, KG_EMU_REDUCE_MIN_U)
KG_EMU_REDUCE(__reduce_min_sync, int, KG_EMU_REDUCE_MIN_S)
KG_EMU_REDUCE(__reduce_max_sync, unsigned, KG_EMU_REDUCE_MAX_U)
KG_EMU_REDUCE(__reduce_max_sync, int, KG_EMU_REDUCE_MAX_S)
KG_EMU_REDUCE(__reduce_and_sync, unsigned, KG_EMU_REDUCE_AND)
KG_EMU_REDUCE(__reduce_or_sync, unsigned, KG_EMU_REDUCE_OR)
KG_EMU_REDUCE(__reduce_xor_sync, unsigned, KG_EMU_REDUCE_XOR)
#undef KG_EMU_REDUCE
static inline unsigned __activemask() { return kg_emu_api_->active_mask(kg_emu_self_); }
static inline void __trap() { kg_emu_api_->trap(kg_emu_self_, "__trap()"); }
static inline void __brkpt() { kg_emu_api_->trap(kg_emu_self_, "__brkpt()"); }

// ---- alignment ----
// The module is built with -fsanitize=alignment: before each load or store through a typed
// pointer the compiler checks the address against the type's alignment and, when it is off, calls
// this handler (defined here, hidden, so no sanitizer runtime is involved). A GPU faults on such
// an access (a float4 from an address that is not a multiple of 16), where the CPU would quietly
// read it; the runtime reports it as the kernel's error instead. The layouts are the compiler's.
struct KgUbsanLocation {
  const char* file;
  unsigned line, column;
};
struct KgUbsanType {
  unsigned short kind, info;
  char name[1];
};
struct KgUbsanMismatch {
  KgUbsanLocation location;
  const KgUbsanType* type;
  unsigned char log_alignment, check_kind;  // check_kind: 0 a load, 1 a store, others
};
extern "C" __attribute__((visibility("hidden"))) void __ubsan_handle_type_mismatch_v1(KgUbsanMismatch* d, void* p) {
  const unsigned long long alignment = 1ull << d->log_alignment;
  if (kg_emu_self_ == nullptr || p == nullptr || ((unsigned long long)p & (alignment - 1)) == 0) return;
  kg_emu_api_->misaligned(kg_emu_self_, p, (unsigned)alignment, d->check_kind == 0 ? 0 : d->check_kind == 1 ? 1 : -1,
                          d->type ? d->type->name : "?", d->location.file, d->location.line);
}
extern "C" __attribute__((visibility("hidden"))) void __ubsan_handle_type_mismatch_v1_abort(KgUbsanMismatch* d,
                                                                                            void* p) {
  __ubsan_handle_type_mismatch_v1(d, p);
}
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __nanosleep(unsigned) {}

// ---- atomics: real atomics on the host (blocks of a grid run on several OS threads) ----
static inline void kg_emu_note_atomic(const void* p) {
  if (kg_emu_self_->checked) kg_emu_api_->note_atomic(kg_emu_self_, p);
}
template <class T>
static inline T kg_emu_fetch_add(T* a, T v) {
  kg_emu_note_atomic(a);
  return __atomic_fetch_add(a, v, __ATOMIC_RELAXED);
}
// Floating-point read-modify-write through a compare-and-swap on the bits.
template <class F, class U, class Op>
static inline F kg_emu_float_rmw(F* a, Op op) {
  kg_emu_note_atomic(a);
  U* p = reinterpret_cast<U*>(a);
  U old = __atomic_load_n(p, __ATOMIC_RELAXED);
  for (;;) {
    F f;
    __builtin_memcpy(&f, &old, sizeof f);
    const F n = op(f);
    U nb;
    __builtin_memcpy(&nb, &n, sizeof nb);
    if (__atomic_compare_exchange_n(p, &old, nb, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return f;
  }
}
static inline int atomicAdd(int* a, int v) { return kg_emu_fetch_add(a, v); }
static inline unsigned atomicAdd(unsigned* a, unsigned v) { return kg_emu_fetch_add(a, v); }
static inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
  return kg_emu_fetch_add(a, v);
}
static inline float atomicAdd(float* a, float v) {
  return kg_emu_float_rmw<float, unsigned>(a, [v](float f) { return f + v; });
}
static inline double atomicAdd(double* a, double v) {
  return kg_emu_float_rmw<double, unsigned long long>(a, [v](double f) { return f + v; });
}
static inline int atomicSub(int* a, int v) { return kg_emu_fetch_add(a, -v); }
static inline unsigned atomicSub(unsigned* a, unsigned v) { return kg_emu_fetch_add(a, 0u - v); }
template <class T>
static inline T kg_emu_exchange(T* a, T v) {
  kg_emu_note_atomic(a);
  return __atomic_exchange_n(a, v, __ATOMIC_RELAXED);
}
static inline int atomicExch(int* a, int v) { return kg_emu_exchange(a, v); }
static inline unsigned atomicExch(unsigned* a, unsigned v) { return kg_emu_exchange(a, v); }
static inline unsigned long long atomicExch(unsigned long long* a, unsigned long long v) {
  return kg_emu_exchange(a, v);
}
static inline float atomicExch(float* a, float v) {
  return kg_emu_float_rmw<float, unsigned>(a, [v](float) { return v; });
}
template <class T>
static inline T kg_emu_cas(T* a, T compare, T v) {
  kg_emu_note_atomic(a);
  __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;  // the old value either way
}
static inline int atomicCAS(int* a, int c, int v) { return kg_emu_cas(a, c, v); }
static inline unsigned atomicCAS(unsigned* a, unsigned c, unsigned v) { return kg_emu_cas(a, c, v); }
static inline unsigned long long atomicCAS(unsigned long long* a, unsigned long long c,
                                           unsigned long long v) {
  return kg_emu_cas(a, c, v);
}
static inline unsigned short atomicCAS(unsigned short* a, unsigned short c, unsigned short v) {
  return kg_emu_cas(a, c, v);
}
template <class T>
static inline T kg_emu_minmax(T* a, T v, bool want_max) {
  kg_emu_note_atomic(a);
  T old = __atomic_load_n(a, __ATOMIC_RELAXED);
  while ((want_max ? v > old : v < old) &&
         !__atomic_compare_exchange_n(a, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
static inline int atomicMax(int* a, int v) { return kg_emu_minmax(a, v, true); }
static inline unsigned atomicMax(unsigned* a, unsigned v) { return kg_emu_minmax(a, v, true); }
static inline long long atomicMax(long long* a, long long v) { return kg_emu_minmax(a, v, true); }
static inline unsigned long long atomicMax(unsigned long long* a, unsigned long long v) {
  return kg_emu_minmax(a, v, true);
}
static inline int atomicMin(int* a, int v) { return kg_emu_minmax(a, v, false); }
static inline unsigned atomicMin(unsigned* a, unsigned v) { return kg_emu_minmax(a, v, false); }
static inline long long atomicMin(long long* a, long long v) { return kg_emu_minmax(a, v, false); }
static inline unsigned long long atomicMin(unsigned long long* a, unsigned long long v) {
  return kg_emu_minmax(a, v, false);
}
static inline float atomicMax(float* a, float v) {
  return kg_emu_float_rmw<float, unsigned>(a, [v](float f) { return fmaxf(f, v); });
}
static inline float atomicMin(float* a, float v) {
  return kg_emu_float_rmw<float, unsigned>(a, [v](float f) { return fminf(f, v); });
}
static inline double atomicMax(double* a, double v) {
  return kg_emu_float_rmw<double, unsigned long long>(a, [v](double f) { return fmax(f, v); });
}
static inline double atomicMin(double* a, double v) {
  return kg_emu_float_rmw<double, unsigned long long>(a, [v](double f) { return fmin(f, v); });
}
#define KG_EMU_BITOP(name, builtin)                                                    \
  static inline int name(int* a, int v) {                                              \
    kg_emu_note_atomic(a);                                                             \
    return builtin(a, v, __ATOMIC_RELAXED);                                            \
  }                                                                                    \
  static inline unsigned name(unsigned* a, unsigned v) {                               \
    kg_emu_note_atomic(a);                                                             \
    return builtin(a, v, __ATOMIC_RELAXED);                                            \
  }                                                                                    \
  static inline unsigned long long name(unsigned long long* a, unsigned long long v) { \
    kg_emu_note_atomic(a);                                                             \
    return builtin(a, v, __ATOMIC_RELAXED);                                            \
  }
KG_EMU_BITOP(atomicAnd, __atomic_fetch_and)
KG_EMU_BITOP(atomicOr, __atomic_fetch_or)
KG_EMU_BITOP(atomicXor, __atomic_fetch_xor)
#undef KG_EMU_BITOP
// ((old >= v) ? 0 : old + 1) and (((old == 0) || (old > v)) ? v : old - 1), as CUDA defines them.
static inline unsigned atomicInc(unsigned* a, unsigned v) {
  kg_emu_note_atomic(a);
  unsigned old = __atomic_load_n(a, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(a, &old, old >= v ? 0u : old + 1u, true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
  }
  return old;
}
static inline unsigned atomicDec(unsigned* a, unsigned v) {
  kg_emu_note_atomic(a);
  unsigned old = __atomic_load_n(a, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(a, &old, (old == 0u || old > v) ? v : old - 1u, true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
  }
  return old;
}
#define atomicAdd_block atomicAdd
#define atomicAdd_system atomicAdd

// ---- loads and stores with cache hints: plain accesses ----
template <class T>
static inline T __ldg(const T* p) {
  return *p;
}
template <class T>
static inline T __ldcg(const T* p) {
  return *p;
}
template <class T>
static inline T __ldca(const T* p) {
  return *p;
}
template <class T>
static inline T __ldcs(const T* p) {
  return *p;
}
template <class T>
static inline T __ldlu(const T* p) {
  return *p;
}
template <class T>
static inline T __ldcv(const T* p) {
  return *p;
}
template <class T>
static inline void __stcg(T* p, T v) {
  *p = v;
}
template <class T>
static inline void __stcs(T* p, T v) {
  *p = v;
}
template <class T>
static inline void __stwb(T* p, T v) {
  *p = v;
}
template <class T>
static inline void __stwt(T* p, T v) {
  *p = v;
}

// ---- min / max: CUDA's overload set ----
#define KG_EMU_MINMAX(R, A, B)                                        \
  static inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; } \
  static inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
KG_EMU_MINMAX(int, int, int)
KG_EMU_MINMAX(unsigned, unsigned, unsigned)
KG_EMU_MINMAX(unsigned, int, unsigned)
KG_EMU_MINMAX(unsigned, unsigned, int)
KG_EMU_MINMAX(long, long, long)
KG_EMU_MINMAX(unsigned long, unsigned long, unsigned long)
KG_EMU_MINMAX(unsigned long, long, unsigned long)
KG_EMU_MINMAX(unsigned long, unsigned long, long)
KG_EMU_MINMAX(long long, long long, long long)
KG_EMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
KG_EMU_MINMAX(unsigned long long, long long, unsigned long long)
KG_EMU_MINMAX(unsigned long long, unsigned long long, long long)
#undef KG_EMU_MINMAX
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
static inline double min(float a, double b) { return fmin(a, b); }
static inline double max(float a, double b) { return fmax(a, b); }
static inline double min(double a, float b) { return fmin(a, b); }
static inline double max(double a, float b) { return fmax(a, b); }

// ---- math intrinsics (the libm functions come from math.h) ----
// glibc declares these names itself; they map to the libm functions.
#define __expf expf
#define __exp10f exp10f
#define __logf logf
#define __log2f log2f
#define __log10f log10f
#define __sinf sinf
#define __cosf cosf
#define __tanf tanf
#define __sincosf sincosf
#define __powf powf
static inline float __fdividef(float a, float b) { return a / b; }
static inline float fdividef(float a, float b) { return a / b; }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline float __fsqrt_rn(float x) { return sqrtf(x); }
static inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
static inline float __saturatef(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
static inline double rcbrt(double x) { return 1.0 / cbrt(x); }
static inline float sinpif(float x) { return sinf(3.14159265358979323846f * x); }
static inline float cospif(float x) { return cosf(3.14159265358979323846f * x); }
static inline double sinpi(double x) { return sin(3.14159265358979323846 * x); }
static inline double cospi(double x) { return cos(3.14159265358979323846 * x); }
static inline void sincospif(float x, float* s, float* c) { sincosf(3.14159265358979323846f * x, s, c); }
static inline float normcdff(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }
static inline double normcdf(double x) { return 0.5 * erfc(-x * 0.70710678118654752440); }

// ---- conversions and bit casts ----
static inline int __float_as_int(float x) { return kg_emu_from_bits<int>(kg_emu_bits(x)); }
static inline unsigned __float_as_uint(float x) { return kg_emu_from_bits<unsigned>(kg_emu_bits(x)); }
static inline float __int_as_float(int x) { return kg_emu_from_bits<float>(kg_emu_bits(x)); }
static inline float __uint_as_float(unsigned x) { return kg_emu_from_bits<float>(kg_emu_bits(x)); }
static inline long long __double_as_longlong(double x) { return kg_emu_from_bits<long long>(kg_emu_bits(x)); }
static inline double __longlong_as_double(long long x) { return kg_emu_from_bits<double>(kg_emu_bits(x)); }
static inline int __double2hiint(double x) { return (int)(kg_emu_bits(x) >> 32); }
static inline int __double2loint(double x) { return (int)(unsigned)kg_emu_bits(x); }
static inline double __hiloint2double(int hi, int lo) {
  return kg_emu_from_bits<double>(((unsigned long long)(unsigned)hi << 32) | (unsigned)lo);
}
static inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
static inline int __float2int_rz(float x) { return (int)x; }
static inline int __float2int_rd(float x) { return (int)floorf(x); }
static inline int __float2int_ru(float x) { return (int)ceilf(x); }
static inline unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
static inline unsigned __float2uint_rz(float x) { return (unsigned)x; }
static inline long long __float2ll_rn(float x) { return (long long)nearbyintf(x); }
static inline long long __float2ll_rz(float x) { return (long long)x; }
static inline int __double2int_rn(double x) { return (int)nearbyint(x); }
static inline int __double2int_rz(double x) { return (int)x; }
static inline long long __double2ll_rn(double x) { return (long long)nearbyint(x); }
static inline float __int2float_rn(int x) { return (float)x; }
static inline float __uint2float_rn(unsigned x) { return (float)x; }
static inline float __ll2float_rn(long long x) { return (float)x; }
static inline double __int2double_rn(int x) { return (double)x; }
static inline double __ll2double_rn(long long x) { return (double)x; }
static inline float __double2float_rn(double x) { return (float)x; }

// ---- integer intrinsics ----
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}
static inline unsigned long long __brevll(unsigned long long x) {
  return ((unsigned long long)__brev((unsigned)x) << 32) | __brev((unsigned)(x >> 32));
}
static inline unsigned __umulhi(unsigned a, unsigned b) {
  return (unsigned)(((unsigned long long)a * b) >> 32);
}
static inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static inline long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }
static inline int __mul24(int a, int b) { return (int)((long long)((a << 8) >> 8) * ((b << 8) >> 8)); }
static inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffffu) * (b & 0xffffffu); }
static inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
  const unsigned long long v = ((unsigned long long)hi << 32) | lo;
  return (unsigned)((v << (s & 31)) >> 32);
}
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  const unsigned long long v = ((unsigned long long)hi << 32) | lo;
  return (unsigned)(v >> (s & 31));
}
static inline int __hadd(int a, int b) { return (int)(((long long)a + b) >> 1); }
static inline int __rhadd(int a, int b) { return (int)(((long long)a + b + 1) >> 1); }
static inline unsigned __uhadd(unsigned a, unsigned b) {
  return (unsigned)(((unsigned long long)a + b) >> 1);
}
static inline unsigned __urhadd(unsigned a, unsigned b) {
  return (unsigned)(((unsigned long long)a + b + 1) >> 1);
}
static inline unsigned __sad(int a, int b, unsigned c) { return (unsigned)(a > b ? a - b : b - a) + c; }
static inline unsigned __usad(unsigned a, unsigned b, unsigned c) { return (a > b ? a - b : b - a) + c; }

// ---- __half and __nv_bfloat16: 16-bit storage, arithmetic in float rounded back ----
static inline float kg_emu_half_to_float(unsigned short h) {
  const unsigned sign = (unsigned)(h & 0x8000u) << 16;
  unsigned exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) {
        man <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (man << 13);
  }
  return kg_emu_from_bits<float>(bits);
}
static inline unsigned short kg_emu_float_to_half(float f) {  // round to nearest even
  const unsigned x = kg_emu_from_bits<unsigned>(kg_emu_bits(f));
  const unsigned sign = (x >> 16) & 0x8000u;
  const int exp = (int)((x >> 23) & 0xff) - 127 + 15;
  unsigned man = x & 0x7fffffu;
  if (((x >> 23) & 0xff) == 0xff) return (unsigned short)(sign | 0x7c00u | (man ? 0x200u : 0u));
  if (exp >= 31) return (unsigned short)(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return (unsigned short)sign;
    man |= 0x800000u;
    const unsigned shift = (unsigned)(14 - exp);
    unsigned half = man >> shift;
    const unsigned rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return (unsigned short)(sign | half);
  }
  unsigned h = sign | ((unsigned)exp << 10) | (man >> 13);
  const unsigned rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return (unsigned short)h;
}
static inline float kg_emu_bf16_to_float(unsigned short b) {
  return kg_emu_from_bits<float>((unsigned)b << 16);
}
static inline unsigned short kg_emu_float_to_bf16(float f) {  // round to nearest even
  const unsigned x = kg_emu_from_bits<unsigned>(kg_emu_bits(f));
  if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
  return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

#define KG_EMU_HALF_TYPE(T, to_f, from_f)                                                \
  struct T {                                                                             \
    unsigned short __x;                                                                  \
    T() = default;                                                                       \
    T(float f) : __x(from_f(f)) {}                                                       \
    T(double f) : __x(from_f((float)f)) {}                                               \
    T(int v) : __x(from_f((float)v)) {}                                                  \
    T(unsigned v) : __x(from_f((float)v)) {}                                             \
    T(long long v) : __x(from_f((float)v)) {}                                            \
    operator float() const { return to_f(__x); }                                         \
    T& operator+=(const T& o) { return *this = T(float(*this) + float(o)); }             \
    T& operator-=(const T& o) { return *this = T(float(*this) - float(o)); }             \
    T& operator*=(const T& o) { return *this = T(float(*this) * float(o)); }             \
    T& operator/=(const T& o) { return *this = T(float(*this) / float(o)); }             \
  };                                                                                     \
  static inline T operator+(const T& a, const T& b) { return T(float(a) + float(b)); }   \
  static inline T operator-(const T& a, const T& b) { return T(float(a) - float(b)); }   \
  static inline T operator*(const T& a, const T& b) { return T(float(a) * float(b)); }   \
  static inline T operator/(const T& a, const T& b) { return T(float(a) / float(b)); }   \
  static inline T operator-(const T& a) {                                                \
    T r = a;                                                                             \
    r.__x ^= 0x8000u;                                                                    \
    return r;                                                                            \
  }                                                                                      \
  static inline bool operator==(const T& a, const T& b) { return float(a) == float(b); } \
  static inline bool operator!=(const T& a, const T& b) { return float(a) != float(b); } \
  static inline bool operator<(const T& a, const T& b) { return float(a) < float(b); }   \
  static inline bool operator<=(const T& a, const T& b) { return float(a) <= float(b); } \
  static inline bool operator>(const T& a, const T& b) { return float(a) > float(b); }   \
  static inline bool operator>=(const T& a, const T& b) { return float(a) >= float(b); }
KG_EMU_HALF_TYPE(__half, kg_emu_half_to_float, kg_emu_float_to_half)
KG_EMU_HALF_TYPE(__nv_bfloat16, kg_emu_bf16_to_float, kg_emu_float_to_bf16)
#undef KG_EMU_HALF_TYPE
typedef __half half;
typedef __nv_bfloat16 nv_bfloat16;
struct __attribute__((aligned(4))) __half2 {
  __half x, y;
};
struct __attribute__((aligned(4))) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
typedef __half2 half2;
typedef __nv_bfloat162 nv_bfloat162;

static inline __half __float2half(float f) { return __half(f); }
static inline __half __float2half_rn(float f) { return __half(f); }
static inline __half __double2half(double f) { return __half((float)f); }
static inline float __half2float(__half h) { return kg_emu_half_to_float(h.__x); }
static inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
static inline float __bfloat162float(__nv_bfloat16 b) { return kg_emu_bf16_to_float(b.__x); }
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }
static inline __half __ushort_as_half(unsigned short v) {
  __half h;
  h.__x = v;
  return h;
}
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short v) {
  __nv_bfloat16 h;
  h.__x = v;
  return h;
}
static inline __half __hadd(__half a, __half b) { return a + b; }
static inline __half __hsub(__half a, __half b) { return a - b; }
static inline __half __hmul(__half a, __half b) { return a * b; }
static inline __half __hdiv(__half a, __half b) { return a / b; }
static inline __half __hneg(__half a) { return -a; }
static inline __half __hfma(__half a, __half b, __half c) {
  return __half(fmaf(float(a), float(b), float(c)));
}
static inline __half __hmax(__half a, __half b) { return __half(fmaxf(float(a), float(b))); }
static inline __half __hmin(__half a, __half b) { return __half(fminf(float(a), float(b))); }
static inline bool __hisnan(__half a) { return isnan(float(a)); }
static inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) { return a + b; }
static inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) { return a - b; }
static inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return a * b; }
static inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return __nv_bfloat16(fmaf(float(a), float(b), float(c)));
}
static inline __half2 __halves2half2(__half a, __half b) { return {a, b}; }
static inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
static inline __half2 __float2half2_rn(float a) { return {__half(a), __half(a)}; }
static inline float2 __half22float2(__half2 h) { return {float(h.x), float(h.y)}; }
static inline __half2 __float22half2_rn(float2 f) { return {__half(f.x), __half(f.y)}; }
static inline __half __low2half(__half2 h) { return h.x; }
static inline __half __high2half(__half2 h) { return h.y; }
static inline float __low2float(__half2 h) { return float(h.x); }
static inline float __high2float(__half2 h) { return float(h.y); }
static inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__nv_bfloat16(a), __nv_bfloat16(b)};
}
static inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {float(h.x), float(h.y)}; }

// ---- what the generated trampolines use ----
template <class T>
constexpr int kg_emu_kind() {
  using U = std::remove_cv_t<T>;
  if (std::is_pointer_v<U>) return KG_EMU_POINTER;
  if (std::is_same_v<U, __half>) return KG_EMU_HALF;
  if (std::is_same_v<U, __nv_bfloat16>) return KG_EMU_BF16;
  if (std::is_floating_point_v<U>) return KG_EMU_FLOAT;
  if (std::is_integral_v<U> || std::is_enum_v<U>)
    return std::is_signed_v<U> ? KG_EMU_SIGNED : KG_EMU_UNSIGNED;
  return KG_EMU_OTHER;
}
template <class T>
KgEmuParam kg_emu_param_of() {
  KgEmuParam p{};
  p.size = sizeof(T);
  p.kind = kg_emu_kind<T>();
  if constexpr (std::is_pointer_v<T>) {
    using E = std::remove_pointer_t<T>;
    if constexpr (std::is_void_v<E>) {
      p.pointee_size = 1;
    } else {
      p.pointee_size = sizeof(E);
    }
    p.pointee_kind = kg_emu_kind<E>();
    p.pointee_const = std::is_const_v<E> ? 1 : 0;
  }
  return p;
}
template <class... P>
int kg_emu_describe(void (*)(P...), KgEmuParam* out, int cap) {
  const KgEmuParam all[] = {kg_emu_param_of<P>()..., KgEmuParam{}};
  const int n = (int)sizeof...(P);
  for (int i = 0; i < n && i < cap; ++i) out[i] = all[i];
  return n;
}
template <class... P, std::size_t... I>
void kg_emu_invoke_(void (*f)(P...), void** a, std::index_sequence<I...>) {
  f(*static_cast<std::remove_cv_t<P>*>(a[I])...);
}
template <class... P>
void kg_emu_invoke(void (*f)(P...), void** a) {
  kg_emu_invoke_(f, a, std::index_sequence_for<P...>{});
}
)KG_CUDA_EMU"
