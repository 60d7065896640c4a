// nn.permute, nn.concat and nn.slice on the GPU: copies that move elements by their width, so
// every dtype is served by the entries for 1-, 2-, 4- and 8-byte elements (_u8 ... _u64).
// This file is also the ops' backward source: permute's gradient is the inverse permutation
// (kg_permute), concat's scatters the output gradient's chunks back to the inputs
// (kg_concat_backward) and slice's fills the input gradient, zero outside the slice
// (kg_slice_backward). Every kernel does nothing when given a null destination (a gradient
// nobody needs).
// A converting permute (ops/shape_ops.cpp) takes the file without its entries (the
// KG_FUSED_MODULE sections) and adds an entry of its own.
// Index math divides through KgDivider (32-bit multiply-high when the tensor has fewer than 2^31
// elements, plain 64-bit division otherwise). The block size and the argument structs are
// shape_ops_shared.cuh's.
#include "index.cuh"
#include "kg_dtype.cuh"
#include "shape_ops_shared.cuh"

// ---- nn.permute ----
// The host merges dims that stay adjacent and drops size-1 dims, then picks one of three paths:
//   gather (tiled_p = -1): each output element read from the source offset of its index;
//     the reads are coalesced when the last output dim is the input's last dim;
//   tiled (tiled_p = the output dim that is the input's last): 32×32 tiles through shared
//     memory, read along the input's last dim and written along the output's last dim, for
//     each entry of the other dims;
//   rows (tiled_p = -2): the output's last dim is short (fewer than KG_PERMUTE_ROW_MAX elements,
//     e.g. the 3 channels of an image going NCHW → NHWC) and the one before it is the input's
//     last: a thread copies one output row, its reads coalesced with its neighbours' along the
//     input's last dim and its writes contiguous.
// The copy is described by a KgPermuteArgs. Elements are copied as they are (S = D, by width) or
// converted from S to D (f32, kg_f16, kg_bf16: a cast folded into the permute).

template <class S, class D>
struct KgPermuteValue {
  __device__ __forceinline__ D operator()(S v) const { return kg_from_compute<D>(kg_to_compute(v)); }
};
template <class E>
struct KgPermuteValue<E, E> {
  __device__ __forceinline__ E operator()(E v) const { return v; }
};

template <class S, class D, bool Small>
__device__ __forceinline__ void kg_permute_gather(const S* __restrict__ src, D* __restrict__ dst,
                                                  const KgPermuteArgs& p) {
  const int rank = (int)p.rank;
  const KgPermuteValue<S, D> value;
  kg_for_each_unrolled<D, Small ? KG_UNROLL : 1>(
      p.total,
      [&](kg_index i) {
        kg_index rem = i, off = 0;
#pragma unroll
        for (int d = KG_PERMUTE_MAX_DIMS - 1; d > 0; --d) {
          if (d < rank) {
            const kg_index q = kg_div<Small>(p.size[d], rem);
            off += (rem - q * p.size[d].d) * p.src_stride[d];
            rem = q;
          }
        }
        return value(src[off + rem * p.src_stride[0]]);
      },
      [&](kg_index i, D v) { dst[i] = v; });
}

template <class S, class D, bool Small>
__device__ __forceinline__ void kg_permute_tiled(const S* __restrict__ src, D* __restrict__ dst,
                                                 const KgPermuteArgs& p) {
  __shared__ D tile[KG_TILE][KG_TILE + 1];
  const KgPermuteValue<S, D> value;
  const int rank = (int)p.rank, pa = (int)p.tiled_p, pb = rank - 1;
  kg_index a_size = 0, b_size = 0, b_src_stride = 0, a_dst_stride = 0;
#pragma unroll
  for (int d = 0; d < KG_PERMUTE_MAX_DIMS; ++d) {
    if (d == pa) a_size = p.size[d].d, a_dst_stride = p.dst_stride[d];
    if (d == pb) b_size = p.size[d].d, b_src_stride = p.src_stride[d];
  }
  const kg_index tiles = p.tiles_a.d * p.tiles_b.d * (p.total / (a_size * b_size));
  const int tx = threadIdx.x % KG_TILE, ty = threadIdx.x / KG_TILE;
  const int rows = KG_COPY_THREADS / KG_TILE;
  for (kg_index t = blockIdx.x; t < tiles; t += gridDim.x) {
    const kg_index u = kg_div<Small>(p.tiles_a, t), ta = t - u * p.tiles_a.d;
    kg_index rem = kg_div<Small>(p.tiles_b, u), so = 0, dso = 0;
    const kg_index tb = u - rem * p.tiles_b.d;
#pragma unroll
    for (int d = KG_PERMUTE_MAX_DIMS - 1; d >= 0; --d) {
      if (d < rank && d != pa && d != pb) {
        const kg_index q = kg_div<Small>(p.size[d], rem), c = rem - q * p.size[d].d;
        so += c * p.src_stride[d];
        dso += c * p.dst_stride[d];
        rem = q;
      }
    }
    const kg_index a0 = ta * KG_TILE, b0 = tb * KG_TILE;
#pragma unroll
    for (int j = ty; j < KG_TILE; j += rows) {
      const kg_index a = a0 + tx, b = b0 + j;
      if (a < a_size && b < b_size) tile[j][tx] = value(src[so + a + b * b_src_stride]);
    }
    __syncthreads();
#pragma unroll
    for (int j = ty; j < KG_TILE; j += rows) {
      const kg_index a = a0 + j, b = b0 + tx;
      if (a < a_size && b < b_size) dst[dso + a * a_dst_stride + b] = tile[tx][j];
    }
    __syncthreads();
  }
}

template <class S, class D, bool Small>
__device__ __forceinline__ void kg_permute_rows(const S* __restrict__ src, D* __restrict__ dst,
                                                const KgPermuteArgs& p) {
  const KgPermuteValue<S, D> value;
  const int rank = (int)p.rank;
  const int row = (int)p.size[rank - 1].d;
  const kg_index row_stride = p.src_stride[rank - 1];
  const kg_index rows = p.total / row;
  for (kg_index r = kg_thread_index(); r < rows; r += kg_grid_stride()) {
    kg_index rem = r, off = 0;
#pragma unroll
    for (int d = KG_PERMUTE_MAX_DIMS - 2; d > 0; --d) {
      if (d < rank - 1) {
        const kg_index q = kg_div<Small>(p.size[d], rem);
        off += (rem - q * p.size[d].d) * p.src_stride[d];
        rem = q;
      }
    }
    off += rem * p.src_stride[0];
    D v[KG_PERMUTE_ROW_MAX];
#pragma unroll
    for (int b = 0; b < KG_PERMUTE_ROW_MAX; ++b)
      if (b < row) v[b] = value(src[off + b * row_stride]);
#pragma unroll
    for (int b = 0; b < KG_PERMUTE_ROW_MAX; ++b)
      if (b < row) dst[r * row + b] = v[b];
  }
}

template <class S, class D = S>
__device__ __forceinline__ void kg_permute(const S* __restrict__ src, D* __restrict__ dst,
                                           const KgPermuteArgs& p) {
  if (!dst) return;
  if (p.tiled_p == -2 && p.total < (1LL << 31))
    kg_permute_rows<S, D, true>(src, dst, p);
  else if (p.tiled_p == -2)
    kg_permute_rows<S, D, false>(src, dst, p);
  else if (p.tiled_p >= 0 && p.total < (1LL << 31))
    kg_permute_tiled<S, D, true>(src, dst, p);
  else if (p.tiled_p >= 0)
    kg_permute_tiled<S, D, false>(src, dst, p);
  else if (p.total < (1LL << 31))
    kg_permute_gather<S, D, true>(src, dst, p);
  else
    kg_permute_gather<S, D, false>(src, dst, p);
}

#ifndef KG_FUSED_MODULE
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_permute_u8(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst, KgPermuteArgs p) {
  kg_permute<unsigned char>(src, dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_permute_u16(const unsigned short* __restrict__ src, unsigned short* __restrict__ dst,
                   KgPermuteArgs p) {
  kg_permute<unsigned short>(src, dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_permute_u32(const unsigned int* __restrict__ src, unsigned int* __restrict__ dst, KgPermuteArgs p) {
  kg_permute<unsigned int>(src, dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_permute_u64(const unsigned long long* __restrict__ src, unsigned long long* __restrict__ dst,
                   KgPermuteArgs p) {
  kg_permute<unsigned long long>(src, dst, p);
}
#endif  // KG_FUSED_MODULE

// ---- nn.concat ----
// The output is [outer, row]; input k fills columns offset[k] .. offset[k] + chunk[k] of each
// row. One launch copies up to KG_CONCAT_MAX inputs, blockIdx.y choosing the input; its blocks
// stride over that input's outer * chunk elements, read contiguously (a KgConcatArgs).

template <class E, bool Small>
__device__ __forceinline__ void kg_concat_copy(const E* __restrict__ src, E* __restrict__ dst, kg_index n,
                                               kg_index chunk, const KgDivider& div, kg_index row) {
  kg_for_each_unrolled<E, Small ? KG_UNROLL : 1>(
      n, [&](kg_index i) { return src[i]; },
      [&](kg_index i, E v) {
        const kg_index o = kg_div<Small>(div, i);
        dst[o * row + (i - o * chunk)] = v;
      });
}

template <class E>
__device__ __forceinline__ void kg_concat(E* __restrict__ dst, const KgConcatArgs& p) {
  const int k = blockIdx.y;
  const kg_index chunk = p.chunk[k], n = p.outer * chunk;
  const E* src = (const E*)p.src[k];
  E* out = dst + p.offset[k];
  if (n < (1LL << 31))
    kg_concat_copy<E, true>(src, out, n, chunk, p.chunk_div[k], p.row);
  else
    kg_concat_copy<E, false>(src, out, n, chunk, p.chunk_div[k], p.row);
}


#ifndef KG_FUSED_MODULE
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_concat_u8(unsigned char* __restrict__ dst, KgConcatArgs p) {
  kg_concat<unsigned char>(dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_concat_u16(unsigned short* __restrict__ dst, KgConcatArgs p) {
  kg_concat<unsigned short>(dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_concat_u32(unsigned int* __restrict__ dst, KgConcatArgs p) {
  kg_concat<unsigned int>(dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_concat_u64(unsigned long long* __restrict__ dst, KgConcatArgs p) {
  kg_concat<unsigned long long>(dst, p);
}
#endif  // KG_FUSED_MODULE

// ---- nn.slice ----
// The output is [outer, len, inner]: out[o, j, r] = src[o * src_outer + src_begin + j * src_step
// + r] (element offsets). A step-1 slice is passed with len = 1 and inner = len * inner.

template <class E, bool Small>
__device__ __forceinline__ void kg_slice(const E* __restrict__ src, E* __restrict__ dst, kg_index total,
                                         const KgDivider& inner, const KgDivider& len, kg_index src_outer,
                                         kg_index src_begin, kg_index src_step) {
  kg_for_each_unrolled<E, Small ? KG_UNROLL : 1>(
      total,
      [&](kg_index i) {
        const kg_index q = kg_div<Small>(inner, i), r = i - q * inner.d;
        const kg_index o = kg_div<Small>(len, q), j = q - o * len.d;
        return src[o * src_outer + src_begin + j * src_step + r];
      },
      [&](kg_index i, E v) { dst[i] = v; });
}

template <class E>
__device__ __forceinline__ void kg_slice_any(const E* __restrict__ src, E* __restrict__ dst, long long total,
                                             const KgDivider& inner, const KgDivider& len,
                                             long long src_outer, long long src_begin, long long src_step) {
  if (!dst) return;
  if (total < (1LL << 31))
    kg_slice<E, true>(src, dst, total, inner, len, src_outer, src_begin, src_step);
  else
    kg_slice<E, false>(src, dst, total, inner, len, src_outer, src_begin, src_step);
}


#ifndef KG_FUSED_MODULE
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_slice_u8(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst, long long total,
                KgDivider inner, KgDivider len, long long src_outer, long long src_begin,
                long long src_step) {
  kg_slice_any<unsigned char>(src, dst, total, inner, len, src_outer, src_begin, src_step);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_slice_u16(const unsigned short* __restrict__ src, unsigned short* __restrict__ dst, long long total,
                 KgDivider inner, KgDivider len, long long src_outer, long long src_begin,
                 long long src_step) {
  kg_slice_any<unsigned short>(src, dst, total, inner, len, src_outer, src_begin, src_step);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_slice_u32(const unsigned int* __restrict__ src, unsigned int* __restrict__ dst, long long total,
                 KgDivider inner, KgDivider len, long long src_outer, long long src_begin,
                 long long src_step) {
  kg_slice_any<unsigned int>(src, dst, total, inner, len, src_outer, src_begin, src_step);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_slice_u64(const unsigned long long* __restrict__ src, unsigned long long* __restrict__ dst,
                 long long total, KgDivider inner, KgDivider len, long long src_outer, long long src_begin,
                 long long src_step) {
  kg_slice_any<unsigned long long>(src, dst, total, inner, len, src_outer, src_begin, src_step);
}
#endif  // KG_FUSED_MODULE

// ---- backward: nn.concat ----
// Input k's gradient is columns offset[k] .. offset[k] + chunk[k] of each row of dy ([outer,
// row]): launches as the forward's, `src[k]` now naming the gradient written (null: skipped).

template <class E, bool Small>
__device__ __forceinline__ void kg_concat_backward_copy(const E* __restrict__ dy, E* __restrict__ dst,
                                                        kg_index n, kg_index chunk, const KgDivider& div,
                                                        kg_index row) {
  kg_for_each_unrolled<E, Small ? KG_UNROLL : 1>(
      n,
      [&](kg_index i) {
        const kg_index o = kg_div<Small>(div, i);
        return dy[o * row + (i - o * chunk)];
      },
      [&](kg_index i, E v) { dst[i] = v; });
}

template <class E>
__device__ __forceinline__ void kg_concat_backward(const E* __restrict__ dy, const KgConcatArgs& p) {
  const int k = blockIdx.y;
  E* dst = (E*)p.src[k];
  if (!dst) return;
  const kg_index chunk = p.chunk[k], n = p.outer * chunk;
  const E* src = dy + p.offset[k];
  if (n < (1LL << 31))
    kg_concat_backward_copy<E, true>(src, dst, n, chunk, p.chunk_div[k], p.row);
  else
    kg_concat_backward_copy<E, false>(src, dst, n, chunk, p.chunk_div[k], p.row);
}


#ifndef KG_FUSED_MODULE
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_concat_backward_u8(const unsigned char* __restrict__ dy, KgConcatArgs p) {
  kg_concat_backward<unsigned char>(dy, p);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_concat_backward_u16(const unsigned short* __restrict__ dy, KgConcatArgs p) {
  kg_concat_backward<unsigned short>(dy, p);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_concat_backward_u32(const unsigned int* __restrict__ dy, KgConcatArgs p) {
  kg_concat_backward<unsigned int>(dy, p);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_concat_backward_u64(const unsigned long long* __restrict__ dy, KgConcatArgs p) {
  kg_concat_backward<unsigned long long>(dy, p);
}
#endif  // KG_FUSED_MODULE

// ---- backward: nn.slice ----
// dx is [outer, size, inner]; dx[o, s, r] = dy[o, (s - begin) / step, r] where s - begin is a
// non-negative multiple of step below len * step, and 0 elsewhere: every element written, each
// once (a gather, no atomics).

template <class E, bool Small>
__device__ __forceinline__ void kg_slice_backward_gather(const E* __restrict__ dy, E* __restrict__ dx,
                                                         kg_index total, const KgDivider& inner,
                                                         const KgDivider& size, const KgDivider& step,
                                                         kg_index begin, kg_index len) {
  kg_for_each_unrolled<E, Small ? KG_UNROLL : 1>(
      total,
      [&](kg_index i) {
        const kg_index q = kg_div<Small>(inner, i), r = i - q * inner.d;
        const kg_index o = kg_div<Small>(size, q), d = q - o * size.d - begin;
        if (d < 0) return E(0);
        const kg_index j = kg_div<Small>(step, d);
        return (d - j * step.d == 0 && j < len) ? dy[(o * len + j) * inner.d + r] : E(0);
      },
      [&](kg_index i, E v) { dx[i] = v; });
}

template <class E>
__device__ __forceinline__ void kg_slice_backward(const E* __restrict__ dy, E* __restrict__ dx,
                                                  long long total, const KgDivider& inner,
                                                  const KgDivider& size, const KgDivider& step,
                                                  long long begin, long long len) {
  if (!dx) return;
  if (total < (1LL << 31))
    kg_slice_backward_gather<E, true>(dy, dx, total, inner, size, step, begin, len);
  else
    kg_slice_backward_gather<E, false>(dy, dx, total, inner, size, step, begin, len);
}

#ifndef KG_FUSED_MODULE
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_slice_backward_u8(const unsigned char* __restrict__ dy, unsigned char* __restrict__ dx,
                         long long total, KgDivider inner, KgDivider size, KgDivider step, long long begin,
                         long long len) {
  kg_slice_backward<unsigned char>(dy, dx, total, inner, size, step, begin, len);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_slice_backward_u16(const unsigned short* __restrict__ dy, unsigned short* __restrict__ dx,
                          long long total, KgDivider inner, KgDivider size, KgDivider step, long long begin,
                          long long len) {
  kg_slice_backward<unsigned short>(dy, dx, total, inner, size, step, begin, len);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_slice_backward_u32(const unsigned int* __restrict__ dy, unsigned int* __restrict__ dx, long long total,
                          KgDivider inner, KgDivider size, KgDivider step, long long begin, long long len) {
  kg_slice_backward<unsigned int>(dy, dx, total, inner, size, step, begin, len);
}
extern "C" __global__ void __launch_bounds__(KG_COPY_THREADS)
    kg_slice_backward_u64(const unsigned long long* __restrict__ dy, unsigned long long* __restrict__ dx,
                          long long total, KgDivider inner, KgDivider size, KgDivider step, long long begin,
                          long long len) {
  kg_slice_backward<unsigned long long>(dy, dx, total, inner, size, step, begin, len);
}
#endif  // KG_FUSED_MODULE
