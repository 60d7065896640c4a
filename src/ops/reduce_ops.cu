// The reduction family on the GPU: reduce.<fn> over any set of axes, reduce.argmax / argmin along
// one axis, and reduce.cumsum along one axis. Every entry takes its layout by value from
// ops/reduce_ops.cpp (the structs and limits are reduce_ops_shared.cuh's).
//
// Each op's kernel source is this file, with KG_REDUCE_ONE_ENTRY defined, followed by its one
// entry (kg_reduce_<fn>_<dtype>, kg_argmax_<dtype>, kg_argmin_<dtype> or kg_cumsum_<dtype>, the
// dtype f32, f64, i32 or i64) calling one of the bodies below: ops/reduce_ops.cpp writes it. One
// entry per module keeps compiles, PTX checks and module loads to what a model uses. Compiled
// alone (kgraph compile --all), the file instantiates every entry.
//
// reduce.<fn> and arg-max/min: output element o reduces the input elements base(o) + offset(r),
// r in [0, count), with the input's dims merged on the host into at most KG_REDUCE_MAX_DIMS kept
// and reduced dims (KgReduceArgs). Who reduces one output element depends on count and the layout
// (the host picks; reduce_ops_shared.cuh gives the rule):
//   one thread (few elements), grid-strided over the outputs;
//   columns (the innermost input dim kept): 32 adjacent outputs per block, lane j taking output
//     j, so that every load of a warp reads 32 adjacent elements; the 8 warps split r and their
//     partials meet in shared memory;
//   one warp (lanes strided over r, a shuffle tree);
//   one block (threads strided over r, shuffles, then shared memory).
// With too few outputs to fill the GPU (one output of a million elements), the block and columns
// layouts split each output's elements into shares that blocks of their own reduce into partials
// in the scratch buffer; a second launch of the same entry, a thread per output, combines them.
// Each thread folds its elements in order of r and the partials meet in a fixed tree, so every
// run gives the same bits. Floats accumulate in double (f32 too); integers in 64 bits and wrap
// like two's complement in their own width (sums and products modulo 2^64 keep the low bits).
// Max and Min propagate NaN; arg-max/min take NaN as larger (or smaller) than any number, as
// numpy does, and break ties by the first index (the last with select_last).
//
// reduce.cumsum: the input is [outer, n, inner] with the scan along n. Lines of up to
// KG_CUMSUM_SERIAL_MAX elements (and long lines when there are many strided ones) are scanned by
// one thread each, a serial loop: adjacent threads take adjacent columns, so the reads coalesce
// when inner > 1. Longer lines that are contiguous (inner == 1) or few take a block each, which
// scans KG_REDUCE_THREADS elements at a time (warp shuffles, then the warps' totals) and carries
// the running sum to the next tile.
#include "index.cuh"
#include "prologue.cuh"
#include "reduce.cuh"
#include "reduce_ops_shared.cuh"

// The functions, in ops::ReduceFn order.
#define KG_RSUM 0
#define KG_RMEAN 1
#define KG_RMAX 2
#define KG_RMIN 3
#define KG_RPROD 4
#define KG_RL1 5
#define KG_RL2 6
#define KG_RSUM_SQUARE 7
#define KG_RLOG_SUM 8
#define KG_RLOG_SUM_EXP 9

// ---- types ----

template <bool C, class A, class B>
struct KgReduceIf {
  typedef A type;
};
template <class A, class B>
struct KgReduceIf<false, A, B> {
  typedef B type;
};

// The integer element types (i32, i64) and their ranges as long long.
template <class T>
struct KgReduceInt {
  static constexpr bool value = false;
};
template <>
struct KgReduceInt<int> {
  static constexpr bool value = true;
  static __device__ __forceinline__ long long lowest() { return -2147483647LL - 1; }
  static __device__ __forceinline__ long long highest() { return 2147483647LL; }
};
template <>
struct KgReduceInt<long long> {
  static constexpr bool value = true;
  static __device__ __forceinline__ long long lowest() { return -9223372036854775807LL - 1; }
  static __device__ __forceinline__ long long highest() { return 9223372036854775807LL; }
};

template <class T>
__device__ __forceinline__ bool kg_reduce_is_nan(T v) {
  if constexpr (KgReduceInt<T>::value)
    return false;
  else
    return v != v;
}

// +infinity in double.
__device__ __forceinline__ double kg_reduce_inf() { return -kg_neg_inf<double>(); }

// ---- index math ----

__device__ __forceinline__ kg_index kg_reduce_div(const KgDivider& f, kg_index n, bool small) {
  return small ? kg_div<true>(f, n) : kg_div<false>(f, n);
}

// The input offset where output element o's reduced elements start: o unravelled over the kept
// dims.
__device__ __forceinline__ kg_index kg_reduce_base(const KgReduceArgs& a, kg_index o) {
  const bool small = a.small != 0;
  kg_index off = 0;
#pragma unroll
  for (int d = KG_REDUCE_MAX_DIMS - 1; d > 0; --d) {
    if (d < a.kept_rank) {
      const kg_index q = kg_reduce_div(a.kept[d], o, small);
      off += (o - q * a.kept[d].d) * a.kept_stride[d];
      o = q;
    }
  }
  return a.kept_rank > 0 ? off + o * a.kept_stride[0] : 0;
}

// The offset of reduced element r from its output's base: r unravelled over the reduced dims.
__device__ __forceinline__ kg_index kg_reduce_offset(const KgReduceArgs& a, kg_index r) {
  if (a.red_rank == 1) return r * a.red_stride[0];
  const bool small = a.small != 0;
  kg_index off = 0;
#pragma unroll
  for (int d = KG_REDUCE_MAX_DIMS - 1; d > 0; --d) {
    if (d < a.red_rank) {
      const kg_index q = kg_reduce_div(a.red[d], r, small);
      off += (r - q * a.red[d].d) * a.red_stride[d];
      r = q;
    }
  }
  return a.red_rank > 0 ? off + r * a.red_stride[0] : 0;
}

// ---- what is folded ----
// An op has an accumulator type Acc, init() (the identity), add(acc, x, r) folding in element x
// at index r, and combine(a, b) joining two partials.

// reduce.<fn> for F other than LogSumExp. Floats accumulate in double; integers in unsigned 64
// bits (sums and products wrap, and the low bits are the element type's wrapped result) or, for
// Max and Min, signed 64 bits.
template <class T, int F>
struct KgReduceOp {
  static constexpr bool is_int = KgReduceInt<T>::value;
  static constexpr bool ordered = F == KG_RMAX || F == KG_RMIN;
  typedef typename KgReduceIf<is_int, typename KgReduceIf<ordered, long long, unsigned long long>::type,
                              double>::type Acc;

  __device__ __forceinline__ Acc init() const {
    if constexpr (F == KG_RMAX) {
      if constexpr (is_int)
        return KgReduceInt<T>::lowest();
      else
        return kg_neg_inf<double>();
    } else if constexpr (F == KG_RMIN) {
      if constexpr (is_int)
        return KgReduceInt<T>::highest();
      else
        return kg_reduce_inf();
    } else if constexpr (F == KG_RPROD) {
      return Acc(1);
    } else {
      return Acc(0);
    }
  }
  // What element x contributes: itself, |x| or x².
  __device__ __forceinline__ Acc value(T x) const {
    if constexpr (is_int) {
      if constexpr (ordered) {
        return (long long)x;
      } else {
        const unsigned long long u = (unsigned long long)(long long)x;
        if constexpr (F == KG_RL1)
          return x < 0 ? 0ULL - u : u;
        else if constexpr (F == KG_RSUM_SQUARE)
          return u * u;
        else
          return u;
      }
    } else {
      const double d = (double)x;
      if constexpr (F == KG_RL1)
        return fabs(d);
      else if constexpr (F == KG_RL2 || F == KG_RSUM_SQUARE)
        return d * d;
      else
        return d;
    }
  }
  __device__ __forceinline__ Acc combine(Acc a, Acc b) const {
    if constexpr (F == KG_RMAX)
      return (b > a || kg_reduce_is_nan(b)) ? b : a;  // NaN, once seen, stays
    else if constexpr (F == KG_RMIN)
      return (b < a || kg_reduce_is_nan(b)) ? b : a;
    else if constexpr (F == KG_RPROD)
      return a * b;
    else
      return a + b;
  }
  __device__ __forceinline__ Acc add(Acc a, T x, kg_index) const { return combine(a, value(x)); }
  // The output from the accumulator of `count` elements.
  __device__ __forceinline__ T finish(Acc a, kg_index count) const {
    if constexpr (is_int) {
      return (T)(long long)a;
    } else {
      if constexpr (F == KG_RMEAN)
        return (T)(a / (double)count);  // 0 / 0 = NaN for an empty axis, as numpy
      else if constexpr (F == KG_RL2)
        return (T)sqrt(a);
      else if constexpr (F == KG_RLOG_SUM)
        return (T)log(a);  // log 0 = -inf for an empty axis
      else
        return (T)a;
    }
  }
};

// The second pass of LogSumExp: the sum of exp(x - shift), in double.
template <class T>
struct KgExpSumOp {
  double shift;
  typedef double Acc;
  __device__ __forceinline__ Acc init() const { return 0.0; }
  __device__ __forceinline__ Acc combine(Acc a, Acc b) const { return a + b; }
  __device__ __forceinline__ Acc add(Acc a, T x, kg_index) const { return a + exp((double)x - shift); }
};

// Arg-max/min: the best value so far and its index (-1: none yet).
template <class T>
struct KgArgAcc {
  T v;
  long long i;
};

template <class T, bool Max>
struct KgArgOp {
  bool last;  // ties give the last index instead of the first
  typedef KgArgAcc<T> Acc;
  __device__ __forceinline__ Acc init() const {
    Acc a;
    a.v = T(0);
    a.i = -1;
    return a;
  }
  // True when b wins over a: NaN over any number, then the larger (smaller) value, then on a tie
  // the first (last) index.
  __device__ __forceinline__ bool wins(const Acc& b, const Acc& a) const {
    if (b.i < 0) return false;
    if (a.i < 0) return true;
    const bool bn = kg_reduce_is_nan(b.v), an = kg_reduce_is_nan(a.v);
    if (bn != an) return bn;
    if (bn || b.v == a.v) return last ? b.i > a.i : b.i < a.i;
    return Max ? b.v > a.v : b.v < a.v;
  }
  __device__ __forceinline__ Acc combine(Acc a, Acc b) const { return wins(b, a) ? b : a; }
  __device__ __forceinline__ Acc add(Acc a, T x, kg_index r) const {
    Acc b;
    b.v = x;
    b.i = r;
    return combine(a, b);
  }
};

// ---- the groups of threads that reduce one output element ----

template <class V>
__device__ __forceinline__ V kg_reduce_shfl(V v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
template <class T>
__device__ __forceinline__ KgArgAcc<T> kg_reduce_shfl(KgArgAcc<T> v, int lane_mask) {
  v.v = __shfl_xor_sync(0xffffffffu, v.v, lane_mask);
  v.i = __shfl_xor_sync(0xffffffffu, v.i, lane_mask);
  return v;
}

// Every lane gets the combination of the warp's partials.
template <class Op, class Acc>
__device__ __forceinline__ Acc kg_reduce_warp(const Op& op, Acc v) {
  for (int o = 16; o > 0; o >>= 1) v = op.combine(v, kg_reduce_shfl(v, o));
  return v;
}

// Every thread gets the combination of the block's partials; smem (32 of them) may be reused by
// the next call.
template <class Op, class Acc>
__device__ __forceinline__ Acc kg_reduce_block(const Op& op, Acc v, Acc* smem) {
  v = kg_reduce_warp(op, v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // an earlier call may still read smem
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? smem[lane] : op.init();
  return kg_reduce_warp(op, v);
}

// Columns: every thread gets the combination of the partials of its lane's column, one per warp;
// smem holds KG_REDUCE_THREADS of them and may be reused by the next call.
template <class Op, class Acc>
__device__ __forceinline__ Acc kg_reduce_column(const Op& op, Acc v, Acc* smem) {
  __syncthreads();  // an earlier call may still read smem
  smem[threadIdx.x] = v;
  __syncthreads();
  const int lane = threadIdx.x & 31, warps = (int)(blockDim.x >> 5);
  v = smem[lane];
  for (int w = 1; w < warps; ++w) v = op.combine(v, smem[w * 32 + lane]);
  return v;
}

struct KgReduceGroup {
  int mode;     // KG_REDUCE_BY_*
  int lane;     // this thread's place in the group
  int size;     // threads in the group
  bool active;  // false for a column past the end of its row (it takes part in the barriers only)
};

// A share of one output element's reduced elements: r in [r0, r1), share `split` of a.splits.
struct KgReduceShare {
  kg_index r0, r1, split;
};

// The reduction of output element o's share (its elements from ld(base) on) by the group; every
// thread of the group gets the result. ld is the input's loader (prologue.cuh).
template <class Op, class Load>
__device__ __forceinline__ typename Op::Acc kg_reduce_group(const Op& op, const Load& ld,
                                                            const KgReduceArgs& a, kg_index base,
                                                            const KgReduceGroup& g, const KgReduceShare& sh,
                                                            typename Op::Acc* smem) {
  typename Op::Acc acc = op.init();
  if (g.active)
    for (kg_index r = sh.r0 + g.lane; r < sh.r1; r += g.size)
      acc = op.add(acc, ld(base + kg_reduce_offset(a, r)), r);
  if (g.mode == KG_REDUCE_BY_WARP)
    acc = kg_reduce_warp(op, acc);
  else if (g.mode == KG_REDUCE_BY_BLOCK)
    acc = kg_reduce_block(op, acc, smem);
  else if (g.mode == KG_REDUCE_BY_COLUMNS)
    acc = kg_reduce_column(op, acc, smem);
  return acc;
}

// Share `split` of every output's reduced elements.
__device__ __forceinline__ KgReduceShare kg_reduce_share(const KgReduceArgs& a, kg_index split) {
  KgReduceShare sh;
  sh.split = split;
  sh.r0 = split * a.chunk;
  sh.r1 = sh.r0 + a.chunk < a.count ? sh.r0 + a.chunk : a.count;
  return sh;
}

// Calls body(o, base(o), group, share) for every output element o (and share of its elements,
// when the reduction is split) this thread's group takes. The threads of a warp or block iterate
// together, so their collectives are uniform.
template <class Body>
__device__ __forceinline__ void kg_reduce_outputs(const KgReduceArgs& a, Body body) {
  KgReduceGroup g;
  g.mode = (int)a.mode;
  g.active = true;
  const kg_index splits = a.splits;
  if (a.mode == KG_REDUCE_BY_COLUMNS) {
    // Tiles of KG_REDUCE_COLUMNS adjacent outputs of one row of the innermost kept dim (w long),
    // each tile once per share.
    const kg_index w = a.width;
    const kg_index per_row = (w + KG_REDUCE_COLUMNS - 1) / KG_REDUCE_COLUMNS, tiles = a.outputs / w * per_row;
    g.lane = threadIdx.x >> 5;
    g.size = blockDim.x >> 5;
    for (kg_index t = blockIdx.x; t < tiles * splits; t += gridDim.x) {
      const kg_index tile = t / splits, row = tile / per_row;
      const kg_index j = (tile - row * per_row) * KG_REDUCE_COLUMNS + (threadIdx.x & 31), o = row * w + j;
      g.active = j < w;
      body(o, g.active ? kg_reduce_base(a, o) : 0, g, kg_reduce_share(a, t - tile * splits));
    }
    return;
  }
  kg_index first, step;
  if (a.mode == KG_REDUCE_BY_BLOCK) {
    g.lane = threadIdx.x;
    g.size = blockDim.x;
    first = blockIdx.x;
    step = gridDim.x;
  } else if (a.mode == KG_REDUCE_BY_WARP) {
    g.lane = threadIdx.x & 31;
    g.size = 32;
    first = kg_thread_index() >> 5;
    step = kg_grid_stride() >> 5;
  } else {
    g.lane = 0;
    g.size = 1;
    first = kg_thread_index();
    step = kg_grid_stride();
  }
  for (kg_index t = first; t < a.outputs * splits; t += step) {
    const kg_index o = t / splits;
    body(o, kg_reduce_base(a, o), g, kg_reduce_share(a, t - o * splits));
  }
}

// LogSumExp's partial of a share: its maximum and the sum of exp(x - kg_lse_shift(maximum)).
struct KgLsePart {
  double m, s;
};

// A maximum m that is the result: NaN or +inf.
__device__ __forceinline__ bool kg_lse_special(double m) { return m != m || m == kg_reduce_inf(); }
// What LogSumExp subtracts before exp: the maximum, or 0 when it is -inf (every element -inf, or
// none: the sum is 0 and the result -inf) or the result itself.
__device__ __forceinline__ double kg_lse_shift(double m) {
  return kg_lse_special(m) || m == kg_neg_inf<double>() ? 0.0 : m;
}

// ---- the kernels' bodies ----

// A split reduction's second launch: one thread per output combines its a.splits partials in
// order.
template <class T, int F>
__device__ __forceinline__ void kg_reduce_combine(T* __restrict__ y, const KgReduceArgs& a,
                                                  const void* part) {
  typedef KgReduceOp<T, F == KG_RLOG_SUM_EXP ? KG_RMAX : F> Op;
  const Op op{};
  for (kg_index o = kg_thread_index(); o < a.outputs; o += kg_grid_stride()) {
    if constexpr (F == KG_RLOG_SUM_EXP) {
      const KgLsePart* p = (const KgLsePart*)part + o * a.splits;
      double m = op.init();
      for (kg_index k = 0; k < a.splits; ++k) m = op.combine(m, p[k].m);
      const double shift = kg_lse_shift(m);
      double s = 0.0;
      for (kg_index k = 0; k < a.splits; ++k)
        if (p[k].s != 0.0) s += p[k].s * exp(kg_lse_shift(p[k].m) - shift);
      y[o] = (T)(kg_lse_special(m) ? m : shift + log(s));
    } else {
      const typename Op::Acc* p = (const typename Op::Acc*)part + o * a.splits;
      typename Op::Acc acc = op.init();
      for (kg_index k = 0; k < a.splits; ++k) acc = op.combine(acc, p[k]);
      y[o] = op.finish(acc, a.count);
    }
  }
}

// x reads the input (a loader, prologue.cuh).
template <class T, int F, class Load>
__device__ __forceinline__ void kg_reduce(const Load& x, T* __restrict__ y, const KgReduceArgs& a,
                                          void* __restrict__ part) {
  if (a.stage == KG_REDUCE_STAGE_COMBINE) {
    kg_reduce_combine<T, F>(y, a, part);
    return;
  }
  // LogSumExp first reduces the maximum (so that exp cannot overflow), then sums exp(x - max).
  typedef KgReduceOp<T, F == KG_RLOG_SUM_EXP ? KG_RMAX : F> Op;
  __shared__ typename Op::Acc smem[KG_REDUCE_THREADS];
  const Op op{};
  const bool partial = a.stage == KG_REDUCE_STAGE_PARTIAL;
  kg_reduce_outputs(a, [&](kg_index o, kg_index base, const KgReduceGroup& g, const KgReduceShare& sh) {
    const typename Op::Acc acc = kg_reduce_group(op, x, a, base, g, sh, smem);
    const bool writes = g.lane == 0 && g.active;
    if constexpr (F == KG_RLOG_SUM_EXP) {
      // acc is the maximum. The second pass runs for every column of a block alike (it has
      // barriers).
      const KgExpSumOp<T> e{kg_lse_shift(acc)};
      const double s = kg_reduce_group(e, x, a, base, g, sh, smem);
      if (writes && partial)
        ((KgLsePart*)part)[o * a.splits + sh.split] = KgLsePart{acc, s};
      else if (writes)
        y[o] = (T)(kg_lse_special(acc) ? acc : e.shift + log(s));
    } else {
      if (writes && partial)
        ((typename Op::Acc*)part)[o * a.splits + sh.split] = acc;
      else if (writes)
        y[o] = op.finish(acc, a.count);
    }
  });
}

template <class T, bool Max, class Load>
__device__ __forceinline__ void kg_arg_reduce(const Load& x, long long* __restrict__ y,
                                              const KgReduceArgs& a, int select_last,
                                              void* __restrict__ part) {
  KgArgOp<T, Max> op;
  op.last = select_last != 0;
  KgArgAcc<T>* parts = (KgArgAcc<T>*)part;
  if (a.stage == KG_REDUCE_STAGE_COMBINE) {
    for (kg_index o = kg_thread_index(); o < a.outputs; o += kg_grid_stride()) {
      KgArgAcc<T> best = op.init();
      for (kg_index k = 0; k < a.splits; ++k) best = op.combine(best, parts[o * a.splits + k]);
      y[o] = best.i;
    }
    return;
  }
  __shared__ KgArgAcc<T> smem[KG_REDUCE_THREADS];
  const bool partial = a.stage == KG_REDUCE_STAGE_PARTIAL;
  kg_reduce_outputs(a, [&](kg_index o, kg_index base, const KgReduceGroup& g, const KgReduceShare& sh) {
    const KgArgAcc<T> best = kg_reduce_group(op, x, a, base, g, sh, smem);
    if (g.lane == 0 && g.active) {
      if (partial)
        parts[o * a.splits + sh.split] = best;
      else
        y[o] = best.i;
    }
  });
}

// The running sum's type: double for floats, unsigned 64 bits (wrapping) for integers.
template <class T>
struct KgCumsumAcc {
  typedef typename KgReduceIf<KgReduceInt<T>::value, unsigned long long, double>::type type;
  static __device__ __forceinline__ type widen(T v) {
    if constexpr (KgReduceInt<T>::value)
      return (unsigned long long)(long long)v;
    else
      return (double)v;
  }
  static __device__ __forceinline__ T narrow(type s) {
    if constexpr (KgReduceInt<T>::value)
      return (T)(long long)s;
    else
      return (T)s;
  }
};

template <class T>
__device__ __forceinline__ void kg_cumsum(const T* __restrict__ x, T* __restrict__ y, const KgCumsumArgs& a) {
  typedef KgCumsumAcc<T> C;
  typedef typename C::type Acc;
  const kg_index n = a.n, inner = a.inner, lines = a.outer * a.inner;
  const bool exclusive = a.exclusive != 0, reverse = a.reverse != 0;
  if (!a.by_block) {
    for (kg_index l = kg_thread_index(); l < lines; l += kg_grid_stride()) {
      const kg_index o = l / inner, j = l - o * inner, base = o * n * inner + j;
      Acc s = Acc(0);
      for (kg_index p = 0; p < n; ++p) {
        const kg_index k = base + (reverse ? n - 1 - p : p) * inner;
        const Acc v = C::widen(x[k]);
        if (exclusive) {
          y[k] = C::narrow(s);
          s += v;
        } else {
          s += v;
          y[k] = C::narrow(s);
        }
      }
    }
    return;
  }
  __shared__ Acc totals[KG_REDUCE_THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (kg_index l = blockIdx.x; l < lines; l += gridDim.x) {
    const kg_index o = l / inner, j = l - o * inner, base = o * n * inner + j;
    Acc carry = Acc(0);
    for (kg_index p0 = 0; p0 < n; p0 += blockDim.x) {
      const kg_index p = p0 + threadIdx.x;
      const kg_index k = base + (reverse ? n - 1 - p : p) * inner;
      const Acc v = p < n ? C::widen(x[k]) : Acc(0);
      // The warp's inclusive scan, and each lane's exclusive one.
      Acc incl = v;
      for (int d = 1; d < 32; d <<= 1) {
        const Acc t = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += t;
      }
      Acc excl = __shfl_up_sync(0xffffffffu, incl, 1);
      if (lane == 0) excl = Acc(0);
      if (lane == 31) totals[warp] = incl;
      __syncthreads();
      Acc before = Acc(0), total = Acc(0);
      for (int w = 0; w < warps; ++w) {
        if (w < warp) before += totals[w];
        total += totals[w];
      }
      __syncthreads();  // every thread has read totals before the next tile writes them
      if (p < n) y[k] = C::narrow(carry + before + (exclusive ? excl : incl));
      carry += total;
    }
  }
}

// ---- every entry, when the file is compiled alone ----
// The same entries ops/reduce_ops.cpp writes one at a time.
#ifndef KG_REDUCE_ONE_ENTRY

#define KG_REDUCE_ENTRY extern "C" __global__ void __launch_bounds__(KG_REDUCE_THREADS)
#define KG_REDUCE_TYPED(name, T, F)                                                \
  KG_REDUCE_ENTRY name(const T* __restrict__ x, T* __restrict__ y, KgReduceArgs a, \
                       void* __restrict__ part) {                                  \
    kg_reduce<T, F>(kg_load_ptr(x), y, a, part);                                   \
  }
#define KG_REDUCE_FLOAT_ENTRIES(fn, F)            \
  KG_REDUCE_TYPED(kg_reduce_##fn##_f32, float, F) \
  KG_REDUCE_TYPED(kg_reduce_##fn##_f64, double, F)
#define KG_REDUCE_INT_ENTRIES(fn, F)            \
  KG_REDUCE_TYPED(kg_reduce_##fn##_i32, int, F) \
  KG_REDUCE_TYPED(kg_reduce_##fn##_i64, long long, F)
#define KG_ARG_ENTRY(name, T, Max)                                                                          \
  KG_REDUCE_ENTRY name(const T* __restrict__ x, long long* __restrict__ y, KgReduceArgs a, int select_last, \
                       void* __restrict__ part) {                                                           \
    kg_arg_reduce<T, Max>(kg_load_ptr(x), y, a, select_last, part);                                         \
  }
#define KG_CUMSUM_ENTRY(name, T, unused) \
  KG_REDUCE_ENTRY name(const T* __restrict__ x, T* __restrict__ y, KgCumsumArgs a) { kg_cumsum<T>(x, y, a); }
#define KG_REDUCE_EVERY_DTYPE(M, stem, ...) \
  M(stem##_f32, float, __VA_ARGS__)         \
  M(stem##_f64, double, __VA_ARGS__)        \
  M(stem##_i32, int, __VA_ARGS__)           \
  M(stem##_i64, long long, __VA_ARGS__)

KG_REDUCE_FLOAT_ENTRIES(sum, KG_RSUM)
KG_REDUCE_FLOAT_ENTRIES(mean, KG_RMEAN)
KG_REDUCE_FLOAT_ENTRIES(max, KG_RMAX)
KG_REDUCE_FLOAT_ENTRIES(min, KG_RMIN)
KG_REDUCE_FLOAT_ENTRIES(prod, KG_RPROD)
KG_REDUCE_FLOAT_ENTRIES(l1, KG_RL1)
KG_REDUCE_FLOAT_ENTRIES(l2, KG_RL2)
KG_REDUCE_FLOAT_ENTRIES(sum_square, KG_RSUM_SQUARE)
KG_REDUCE_FLOAT_ENTRIES(log_sum, KG_RLOG_SUM)
KG_REDUCE_FLOAT_ENTRIES(log_sum_exp, KG_RLOG_SUM_EXP)
KG_REDUCE_INT_ENTRIES(sum, KG_RSUM)
KG_REDUCE_INT_ENTRIES(max, KG_RMAX)
KG_REDUCE_INT_ENTRIES(min, KG_RMIN)
KG_REDUCE_INT_ENTRIES(prod, KG_RPROD)
KG_REDUCE_INT_ENTRIES(l1, KG_RL1)
KG_REDUCE_INT_ENTRIES(sum_square, KG_RSUM_SQUARE)
KG_REDUCE_EVERY_DTYPE(KG_ARG_ENTRY, kg_argmax, true)
KG_REDUCE_EVERY_DTYPE(KG_ARG_ENTRY, kg_argmin, false)
KG_REDUCE_EVERY_DTYPE(KG_CUMSUM_ENTRY, kg_cumsum, )

#endif  // KG_REDUCE_ONE_ENTRY
