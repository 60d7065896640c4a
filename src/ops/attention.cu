// nn.attention on the GPU: softmax(scale · Q Kᵀ + mask) V, flash-attention style. Q, K, V and the
// output are contiguous [bh, S, D] (bh the product of the batch dims, heads included). A block
// takes KG_ATTN_WARPS × RW query rows of one bh (a warp RW of them) and walks the keys in tiles of
// BK, held in shared memory with the tile of queries. For each row and key tile, lane j scores key
// j (the dot product in the compute type, f32 for f16/bf16), the warp takes the tile's maximum and
// rescales its running sum and its accumulators (online softmax), then adds p_j · V[j] to the
// accumulators, lane c holding the output columns c, c + 32, ... (D and Dv up to
// KG_ATTN_MAX_HEAD). A masked score is -inf: its p is 0. A row whose every score is -inf (all
// keys masked) has sum 0 and is written as zeros. The mask (additive in the query's dtype, or
// bool) is read through its strides, so any broadcast of [batch..., Sq, Sk] is taken as it is;
// causal masks key j > query i (top-left aligned). The arguments are attention_shared.cuh's.
// No tensor cores yet: plain FMA.
#include "attention_shared.cuh"
#include "reduce.cuh"

__device__ __forceinline__ float kg_attn_exp(float v) { return expf(v); }
__device__ __forceinline__ double kg_attn_exp(double v) { return exp(v); }

template <class T, int RW, int BK>
__device__ __forceinline__ void kg_attention(const T* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, const void* __restrict__ mask,
                                             T* __restrict__ out, const KgAttnArgs& a) {
  typedef kg_compute_t<T> C;
  const int BQ = KG_ATTN_WARPS * RW;
  const int DPL = KG_ATTN_MAX_HEAD / 32;  // output columns per lane
  __shared__ C qs[KG_ATTN_WARPS * RW][KG_ATTN_MAX_HEAD];
  __shared__ C ks[BK][KG_ATTN_MAX_HEAD + 1];  // padded: lanes read one column of BK rows
  __shared__ C vs[BK][KG_ATTN_MAX_HEAD];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const kg_index d = a.d, dv = a.dv, sq = a.sq, sk = a.sk;
  const C scale = (C)a.scale;
  const C neg_inf = kg_neg_inf<C>();
  const kg_index q_tiles = (sq + BQ - 1) / BQ;
  for (kg_index blk = blockIdx.x; blk < a.bh * q_tiles; blk += gridDim.x) {
    const kg_index bh = blk / q_tiles, i0 = (blk - bh * q_tiles) * BQ;
    kg_index moff = 0;
    for (kg_index lv = a.levels - 1, rem = bh; lv >= 0; --lv) {
      const kg_index c = rem % a.size[lv];
      rem /= a.size[lv];
      moff += c * a.mask_stride[lv];
    }
    const T* qb = q + bh * sq * d;
    const T* kb = k + bh * sk * d;
    const T* vb = v + bh * sk * dv;
    __syncthreads();  // the previous block's readers of qs are done
    for (kg_index t = threadIdx.x; t < BQ * d; t += KG_ATTN_THREADS) {
      const kg_index r = t / d, c = t - r * d, i = i0 + r;
      qs[r][c] = i < sq ? kg_ld(qb, i * d + c) : C(0);
    }
    C m[RW], l[RW], acc[RW][DPL];
    for (int rr = 0; rr < RW; ++rr) {
      m[rr] = neg_inf;
      l[rr] = C(0);
      for (int e = 0; e < DPL; ++e) acc[rr][e] = C(0);
    }
    // Causal: no row of this block sees a key past its last row.
    kg_index kend = sk;
    if (a.causal && i0 + BQ < kend) kend = i0 + BQ;
    for (kg_index j0 = 0; j0 < kend; j0 += BK) {
      __syncthreads();  // the previous tile's readers are done
      for (kg_index t = threadIdx.x; t < BK * d; t += KG_ATTN_THREADS) {
        const kg_index r = t / d, c = t - r * d, j = j0 + r;
        ks[r][c] = j < sk ? kg_ld(kb, j * d + c) : C(0);
      }
      for (kg_index t = threadIdx.x; t < BK * dv; t += KG_ATTN_THREADS) {
        const kg_index r = t / dv, c = t - r * dv, j = j0 + r;
        vs[r][c] = j < sk ? kg_ld(vb, j * dv + c) : C(0);
      }
      __syncthreads();
      for (int rr = 0; rr < RW; ++rr) {
        const int r = warp * RW + rr;
        const kg_index i = i0 + r, j = j0 + lane;
        C s = neg_inf;
        if (lane < BK && j < sk && i < sq && !(a.causal && j > i)) {
          C dot = C(0);
          for (kg_index c = 0; c < d; ++c) dot += qs[r][c] * ks[lane][c];
          s = dot * scale;
          const kg_index mi = moff + i * a.mask_sq + j * a.mask_sk;
          if (a.mask_kind == KG_ATTN_MASK_ADD)
            s += kg_ld((const T*)mask, mi);
          else if (a.mask_kind == KG_ATTN_MASK_BOOL && ((const unsigned char*)mask)[mi] == 0)
            s = neg_inf;
        }
        const C mnew = fmax(m[rr], kg_warp_max(s));
        const C shift = mnew == neg_inf ? C(0) : mnew;  // every score so far -inf: p stays 0
        const C p = kg_attn_exp(s - shift);
        const C corr = kg_attn_exp(m[rr] - shift);
        l[rr] = l[rr] * corr + kg_warp_sum(p);
        m[rr] = mnew;
        for (int e = 0; e < DPL; ++e) acc[rr][e] *= corr;
        for (int jj = 0; jj < BK; ++jj) {
          const C pj = __shfl_sync(0xffffffffu, p, jj);
          for (int e = 0; e < DPL; ++e) {
            const kg_index c = lane + 32 * e;
            if (c < dv) acc[rr][e] += pj * vs[jj][c];
          }
        }
      }
    }
    for (int rr = 0; rr < RW; ++rr) {
      const kg_index i = i0 + warp * RW + rr;
      if (i >= sq) continue;
      const C inv = l[rr] > C(0) ? C(1) / l[rr] : C(0);  // a fully masked row: zeros
      T* orow = out + (bh * sq + i) * dv;
      for (int e = 0; e < DPL; ++e) {
        const kg_index c = lane + 32 * e;
        if (c < dv) kg_st(orow, c, acc[rr][e] * inv);
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(KG_ATTN_THREADS)
    kg_attention_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                     const void* __restrict__ mask, float* __restrict__ out, KgAttnArgs args) {
  kg_attention<float, KG_ATTN_ROWS_PER_WARP, KG_ATTN_KEYS>(q, k, v, mask, out, args);
}

extern "C" __global__ void __launch_bounds__(KG_ATTN_THREADS)
    kg_attention_f16(const kg_f16* __restrict__ q, const kg_f16* __restrict__ k, const kg_f16* __restrict__ v,
                     const void* __restrict__ mask, kg_f16* __restrict__ out, KgAttnArgs args) {
  kg_attention<kg_f16, KG_ATTN_ROWS_PER_WARP, KG_ATTN_KEYS>(q, k, v, mask, out, args);
}

extern "C" __global__ void __launch_bounds__(KG_ATTN_THREADS)
    kg_attention_bf16(const kg_bf16* __restrict__ q, const kg_bf16* __restrict__ k, const kg_bf16* __restrict__ v,
                      const void* __restrict__ mask, kg_bf16* __restrict__ out, KgAttnArgs args) {
  kg_attention<kg_bf16, KG_ATTN_ROWS_PER_WARP, KG_ATTN_KEYS>(q, k, v, mask, out, args);
}

extern "C" __global__ void __launch_bounds__(KG_ATTN_THREADS)
    kg_attention_f64(const double* __restrict__ q, const double* __restrict__ k, const double* __restrict__ v,
                     const void* __restrict__ mask, double* __restrict__ out, KgAttnArgs args) {
  kg_attention<double, KG_ATTN_ROWS_PER_WARP_F64, KG_ATTN_KEYS_F64>(q, k, v, mask, out, args);
}
