// The index_ops family on the GPU. Data movement copies elements by their width, so every dtype
// is served by the entries for 1-, 2-, 4- and 8-byte elements (_u8 ... _u64):
//   kg_index_map:            index.expand, index.tile, index.pad and index.slice, one kernel: each
//                            output element reads the input offset its index maps to, dim by dim
//                            (a KgIndexMapArgs), or is the constant of a Constant pad;
//   kg_gather_<w>_<i32|i64>: index.gather, out[o, j, r] = data[o, indices[j], r];
//   kg_gather_elements_...:  index.gather_elements, one index per output element;
//   kg_index_fill:           index.constant_of_shape;
//   kg_index_range_<dtype>:  index.range (i32, i64, f32, f64);
//   kg_index_values:         index.shape, sizes known at launch written into an i64 vector.
// A kernel cannot raise an error: an index outside [-n, n) (which the CPU reports naming it) is
// clamped to [0, n) here, so that a bad index never reads outside the data. A gather from an
// empty axis, where no index is valid, writes zeros (the host launches kg_index_fill instead).
// An index map or a gather_elements of more than KG_INDEX_MAX_DIMS dims (after merging) is
// launched once per index of its leading dims.
// Index math divides through KgDivider (32-bit multiply-high when the output has fewer than 2^31
// elements, plain 64-bit division otherwise); offsets are 64-bit. The block size and the
// argument structs are index_ops_shared.cuh's.
#include "index.cuh"
#include "index_ops_shared.cuh"

// ---- the index map ----

// The input index that output index `o` of a dim reads, or -1 for the constant.
__device__ __forceinline__ kg_index kg_map_index(kg_index o, kg_index start, kg_index step, kg_index n,
                                                 int mode) {
  kg_index k = start + o * step;
  if (k >= 0 && k < n) return k;
  if (mode == KG_MAP_EDGE) return k < 0 ? 0 : n - 1;
  if (mode == KG_MAP_REFLECT) return k < 0 ? -k : 2 * (n - 1) - k;
  if (mode == KG_MAP_WRAP) {
    k %= n;
    return k < 0 ? k + n : k;
  }
  return -1;
}

template <class E, bool Small>
__device__ __forceinline__ void kg_index_map_run(const E* __restrict__ src, E* __restrict__ dst,
                                                 const KgIndexMapArgs& p) {
  const int rank = (int)p.rank, mode = (int)p.mode;
  const E fill = (E)p.value;  // the low bytes: the constant's bit pattern in this width
  kg_for_each_unrolled<E, Small ? KG_UNROLL : 1>(
      p.total,
      [&](kg_index i) {
        kg_index rem = i, off = p.base;
        bool outside = false;
#pragma unroll
        for (int d = KG_INDEX_MAX_DIMS - 1; d >= 0; --d) {
          if (d < rank) {
            kg_index o = rem;
            if (d > 0) {
              const kg_index q = kg_div<Small>(p.size[d], rem);
              o = rem - q * p.size[d].d;
              rem = q;
            }
            const kg_index k = kg_map_index(o, p.start[d], p.step[d], p.in_size[d], mode);
            if (k < 0)
              outside = true;
            else
              off += k * p.stride[d];
          }
        }
        return outside ? fill : src[off];
      },
      [&](kg_index i, E v) { dst[i] = v; });
}

template <class E>
__device__ __forceinline__ void kg_index_map(const E* __restrict__ src, E* __restrict__ dst,
                                             const KgIndexMapArgs& p) {
  if (p.total < (1LL << 31))
    kg_index_map_run<E, true>(src, dst, p);
  else
    kg_index_map_run<E, false>(src, dst, p);
}

extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_index_map_u8(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                    KgIndexMapArgs p) {
  kg_index_map<unsigned char>(src, dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_index_map_u16(const unsigned short* __restrict__ src, unsigned short* __restrict__ dst,
                     KgIndexMapArgs p) {
  kg_index_map<unsigned short>(src, dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_index_map_u32(const unsigned int* __restrict__ src, unsigned int* __restrict__ dst, KgIndexMapArgs p) {
  kg_index_map<unsigned int>(src, dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_index_map_u64(const unsigned long long* __restrict__ src, unsigned long long* __restrict__ dst,
                     KgIndexMapArgs p) {
  kg_index_map<unsigned long long>(src, dst, p);
}

// ---- index.gather ----
// data is [outer, axis_size, inner], the indices [count] (flattened), the output [outer, count,
// inner]. An index below -axis_size or from axis_size on is clamped into [0, axis_size).

template <class I>
__device__ __forceinline__ kg_index kg_clamp_index(I raw, kg_index n) {
  kg_index k = (kg_index)raw;
  if (k < 0) k += n;
  return k < 0 ? 0 : (k >= n ? n - 1 : k);
}

template <class E, class I, bool Small>
__device__ __forceinline__ void kg_gather_run(const E* __restrict__ src, const I* __restrict__ idx,
                                              E* __restrict__ dst, kg_index total, const KgDivider& inner,
                                              const KgDivider& count, kg_index axis_size) {
  kg_for_each_unrolled<E, Small ? KG_UNROLL : 1>(
      total,
      [&](kg_index i) {
        const kg_index q = kg_div<Small>(inner, i), r = i - q * inner.d;
        const kg_index o = kg_div<Small>(count, q), j = q - o * count.d;
        const kg_index k = kg_clamp_index(idx[j], axis_size);
        return src[(o * axis_size + k) * inner.d + r];
      },
      [&](kg_index i, E v) { dst[i] = v; });
}

template <class E, class I>
__device__ __forceinline__ void kg_gather(const E* __restrict__ src, const I* __restrict__ idx,
                                          E* __restrict__ dst, long long total, const KgDivider& inner,
                                          const KgDivider& count, long long axis_size) {
  if (total < (1LL << 31))
    kg_gather_run<E, I, true>(src, idx, dst, total, inner, count, axis_size);
  else
    kg_gather_run<E, I, false>(src, idx, dst, total, inner, count, axis_size);
}

extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_u8_i32(const unsigned char* __restrict__ src, const int* __restrict__ idx,
                     unsigned char* __restrict__ dst, long long total, KgDivider inner, KgDivider count,
                     long long axis_size) {
  kg_gather<unsigned char, int>(src, idx, dst, total, inner, count, axis_size);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_u16_i32(const unsigned short* __restrict__ src, const int* __restrict__ idx,
                      unsigned short* __restrict__ dst, long long total, KgDivider inner, KgDivider count,
                      long long axis_size) {
  kg_gather<unsigned short, int>(src, idx, dst, total, inner, count, axis_size);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_u32_i32(const unsigned int* __restrict__ src, const int* __restrict__ idx,
                      unsigned int* __restrict__ dst, long long total, KgDivider inner, KgDivider count,
                      long long axis_size) {
  kg_gather<unsigned int, int>(src, idx, dst, total, inner, count, axis_size);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_u64_i32(const unsigned long long* __restrict__ src, const int* __restrict__ idx,
                      unsigned long long* __restrict__ dst, long long total, KgDivider inner, KgDivider count,
                      long long axis_size) {
  kg_gather<unsigned long long, int>(src, idx, dst, total, inner, count, axis_size);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_u8_i64(const unsigned char* __restrict__ src, const long long* __restrict__ idx,
                     unsigned char* __restrict__ dst, long long total, KgDivider inner, KgDivider count,
                     long long axis_size) {
  kg_gather<unsigned char, long long>(src, idx, dst, total, inner, count, axis_size);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_u16_i64(const unsigned short* __restrict__ src, const long long* __restrict__ idx,
                      unsigned short* __restrict__ dst, long long total, KgDivider inner, KgDivider count,
                      long long axis_size) {
  kg_gather<unsigned short, long long>(src, idx, dst, total, inner, count, axis_size);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_u32_i64(const unsigned int* __restrict__ src, const long long* __restrict__ idx,
                      unsigned int* __restrict__ dst, long long total, KgDivider inner, KgDivider count,
                      long long axis_size) {
  kg_gather<unsigned int, long long>(src, idx, dst, total, inner, count, axis_size);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_u64_i64(const unsigned long long* __restrict__ src, const long long* __restrict__ idx,
                      unsigned long long* __restrict__ dst, long long total, KgDivider inner, KgDivider count,
                      long long axis_size) {
  kg_gather<unsigned long long, long long>(src, idx, dst, total, inner, count, axis_size);
}

// ---- index.gather_elements ----
// Output element i (index c over the output's dims) reads data at c with c[axis] replaced by
// indices[i] (clamped as gather's). The host merges dims and, past KG_INDEX_MAX_DIMS, launches
// once per index of the leading dims with the pointers moved to that block.

template <class E, class I, bool Small>
__device__ __forceinline__ void kg_gather_elements_run(const E* __restrict__ src, const I* __restrict__ idx,
                                                       E* __restrict__ dst, const KgGatherElementsArgs& p) {
  const int rank = (int)p.rank, axis = (int)p.axis;
  kg_for_each_unrolled<E, Small ? KG_UNROLL : 1>(
      p.total,
      [&](kg_index i) {
        kg_index rem = i, off = 0;
#pragma unroll
        for (int d = KG_INDEX_MAX_DIMS - 1; d >= 0; --d) {
          if (d < rank) {
            kg_index c = rem;
            if (d > 0) {
              const kg_index q = kg_div<Small>(p.size[d], rem);
              c = rem - q * p.size[d].d;
              rem = q;
            }
            if (d != axis) off += c * p.stride[d];
          }
        }
        return src[off + kg_clamp_index(idx[i], p.axis_size) * p.axis_stride];
      },
      [&](kg_index i, E v) { dst[i] = v; });
}

template <class E, class I>
__device__ __forceinline__ void kg_gather_elements(const E* __restrict__ src, const I* __restrict__ idx,
                                                   E* __restrict__ dst, const KgGatherElementsArgs& p) {
  if (p.total < (1LL << 31))
    kg_gather_elements_run<E, I, true>(src, idx, dst, p);
  else
    kg_gather_elements_run<E, I, false>(src, idx, dst, p);
}

extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_elements_u8_i32(const unsigned char* __restrict__ src, const int* __restrict__ idx,
                              unsigned char* __restrict__ dst, KgGatherElementsArgs p) {
  kg_gather_elements<unsigned char, int>(src, idx, dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_elements_u16_i32(const unsigned short* __restrict__ src, const int* __restrict__ idx,
                               unsigned short* __restrict__ dst, KgGatherElementsArgs p) {
  kg_gather_elements<unsigned short, int>(src, idx, dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_elements_u32_i32(const unsigned int* __restrict__ src, const int* __restrict__ idx,
                               unsigned int* __restrict__ dst, KgGatherElementsArgs p) {
  kg_gather_elements<unsigned int, int>(src, idx, dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_elements_u64_i32(const unsigned long long* __restrict__ src, const int* __restrict__ idx,
                               unsigned long long* __restrict__ dst, KgGatherElementsArgs p) {
  kg_gather_elements<unsigned long long, int>(src, idx, dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_elements_u8_i64(const unsigned char* __restrict__ src, const long long* __restrict__ idx,
                              unsigned char* __restrict__ dst, KgGatherElementsArgs p) {
  kg_gather_elements<unsigned char, long long>(src, idx, dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_elements_u16_i64(const unsigned short* __restrict__ src, const long long* __restrict__ idx,
                               unsigned short* __restrict__ dst, KgGatherElementsArgs p) {
  kg_gather_elements<unsigned short, long long>(src, idx, dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_elements_u32_i64(const unsigned int* __restrict__ src, const long long* __restrict__ idx,
                               unsigned int* __restrict__ dst, KgGatherElementsArgs p) {
  kg_gather_elements<unsigned int, long long>(src, idx, dst, p);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_gather_elements_u64_i64(const unsigned long long* __restrict__ src, const long long* __restrict__ idx,
                               unsigned long long* __restrict__ dst, KgGatherElementsArgs p) {
  kg_gather_elements<unsigned long long, long long>(src, idx, dst, p);
}

// ---- index.constant_of_shape ----
// Every element is `bits` (the low bytes, in the element's width).

template <class E>
__device__ __forceinline__ void kg_index_fill(E* __restrict__ dst, long long total, unsigned long long bits) {
  const E v = (E)bits;
  const kg_index stride = kg_grid_stride();
  for (kg_index i = kg_thread_index(); i < total; i += stride) dst[i] = v;
}

extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_index_fill_u8(unsigned char* __restrict__ dst, long long total, unsigned long long bits) {
  kg_index_fill<unsigned char>(dst, total, bits);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_index_fill_u16(unsigned short* __restrict__ dst, long long total, unsigned long long bits) {
  kg_index_fill<unsigned short>(dst, total, bits);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_index_fill_u32(unsigned int* __restrict__ dst, long long total, unsigned long long bits) {
  kg_index_fill<unsigned int>(dst, total, bits);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_index_fill_u64(unsigned long long* __restrict__ dst, long long total, unsigned long long bits) {
  kg_index_fill<unsigned long long>(dst, total, bits);
}

// ---- index.range ----
// dst[i] = start + i * delta: in 64-bit integers for i32 and i64 (then narrowed), in double for
// f32 and f64 (then rounded), as the CPU computes it.

extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_index_range_i32(int* __restrict__ dst, long long total, long long start, long long delta) {
  const kg_index stride = kg_grid_stride();
  for (kg_index i = kg_thread_index(); i < total; i += stride) dst[i] = (int)(start + i * delta);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_index_range_i64(long long* __restrict__ dst, long long total, long long start, long long delta) {
  const kg_index stride = kg_grid_stride();
  for (kg_index i = kg_thread_index(); i < total; i += stride) dst[i] = start + i * delta;
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_index_range_f32(float* __restrict__ dst, long long total, long long start, long long delta) {
  const kg_index stride = kg_grid_stride();
  for (kg_index i = kg_thread_index(); i < total; i += stride)
    dst[i] = (float)((double)start + (double)i * (double)delta);
}
extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_index_range_f64(double* __restrict__ dst, long long total, long long start, long long delta) {
  const kg_index stride = kg_grid_stride();
  for (kg_index i = kg_thread_index(); i < total; i += stride)
    dst[i] = (double)start + (double)i * (double)delta;
}

// ---- index.shape ----
// dst[offset + j] = v.v[j] for j < v.count: one launch per KG_INDEX_VALUES sizes.

extern "C" __global__ void __launch_bounds__(KG_INDEX_THREADS)
    kg_index_values(long long* __restrict__ dst, long long offset, KgIndexValues v) {
  const kg_index j = kg_thread_index();
  if (j < v.count) dst[offset + j] = v.v[j];
}
