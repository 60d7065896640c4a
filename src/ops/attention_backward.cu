// nn.attention's backward on the GPU (f32, f64), recomputing the probabilities
// p_ij = exp(s_ij - lse_i) from the scores s_ij = scale q_i·k_j + mask_ij (masked: p = 0):
//   launch 0, a warp per query row: lse_i (+inf for a row whose every key is masked) and
//             d_i = Σ_c dO_ic O_ic, into the scratch (2 · bh · Sq values of the compute type);
//   launch 1, a warp per query row: ds_ij = p_ij (dO_i·v_j - d_i), dq_i = scale Σ_j ds_ij k_j, and
//             ds_ij itself as the additive mask's gradient when it is wanted (the host allows that
//             only for a mask of the scores' full shape, so each element is written once);
//   launch 2, a warp per key: dv_j = Σ_i p_ij dO_i, dk_j = scale Σ_i ds_ij q_i.
// Lanes take keys (launch 1) or queries (launch 2) 32 at a time, then each lane sums its output
// columns c, c + 32, ... Plain loads from global memory: a correct reference, not a fast one.
// KgAttnArgs is attention_shared.cuh's.
#include "attention_shared.cuh"
#include "reduce.cuh"

__device__ __forceinline__ float kg_attn_bwd_exp(float v) { return expf(v); }
__device__ __forceinline__ double kg_attn_bwd_exp(double v) { return exp(v); }
__device__ __forceinline__ float kg_attn_bwd_log(float v) { return logf(v); }
__device__ __forceinline__ double kg_attn_bwd_log(double v) { return log(v); }

template <class T>
__device__ __forceinline__ kg_index kg_attn_mask_base(const KgAttnArgs& a, kg_index bh) {
  kg_index off = 0;
  for (kg_index lv = a.levels - 1, rem = bh; lv >= 0; --lv) {
    off += (rem % a.size[lv]) * a.mask_stride[lv];
    rem /= a.size[lv];
  }
  return off;
}

// The score of (query i, key j) of batch entry bh, or -inf where masked.
template <class T>
__device__ __forceinline__ T kg_attn_score(const T* q, const T* k, const void* mask, const KgAttnArgs& a,
                                           kg_index bh, kg_index moff, kg_index i, kg_index j) {
  if (j >= a.sk || i >= a.sq || (a.causal && j > i)) return kg_neg_inf<T>();
  const kg_index mi = moff + i * a.mask_sq + j * a.mask_sk;
  if (a.mask_kind == KG_ATTN_MASK_BOOL && ((const unsigned char*)mask)[mi] == 0) return kg_neg_inf<T>();
  const T* qr = q + (bh * a.sq + i) * a.d;
  const T* kr = k + (bh * a.sk + j) * a.d;
  T s = T(0);
  for (kg_index c = 0; c < a.d; ++c) s += qr[c] * kr[c];
  s *= (T)a.scale;
  if (a.mask_kind == KG_ATTN_MASK_ADD) s += ((const T*)mask)[mi];
  return s;
}

// p from a score and its row's lse (a fully masked row has lse = +inf: p = 0).
template <class T>
__device__ __forceinline__ T kg_attn_prob(T s, T lse) {
  return s == kg_neg_inf<T>() ? T(0) : kg_attn_bwd_exp(s - lse);
}

#define KG_ATTN_BWD_WARP_LOOP(count)                                                                    \
  const int lane = threadIdx.x & 31;                                                                   \
  for (kg_index w = ((kg_index)blockIdx.x * blockDim.x + threadIdx.x) / 32; w < (count);               \
       w += (kg_index)gridDim.x * blockDim.x / 32)

template <class T>
__device__ __forceinline__ void kg_attention_bwd_rows(const T* q, const T* k, const void* mask, const T* out,
                                                      const T* dout, T* lse, T* dsum, const KgAttnArgs& a) {
  KG_ATTN_BWD_WARP_LOOP(a.bh * a.sq) {
    const kg_index bh = w / a.sq, i = w - bh * a.sq;
    const kg_index moff = kg_attn_mask_base<T>(a, bh);
    T m = kg_neg_inf<T>();
    for (kg_index j = lane; j < a.sk; j += 32) m = fmax(m, kg_attn_score(q, k, mask, a, bh, moff, i, j));
    m = kg_warp_max(m);
    T sum = T(0);
    if (m != kg_neg_inf<T>())
      for (kg_index j = lane; j < a.sk; j += 32) sum += kg_attn_prob(kg_attn_score(q, k, mask, a, bh, moff, i, j), m);
    sum = kg_warp_sum(sum);
    T dd = T(0);
    for (kg_index c = lane; c < a.dv; c += 32) dd += dout[w * a.dv + c] * out[w * a.dv + c];
    dd = kg_warp_sum(dd);
    if (lane == 0) {
      lse[w] = m == kg_neg_inf<T>() ? -kg_neg_inf<T>() : m + kg_attn_bwd_log(sum);
      dsum[w] = dd;
    }
  }
}

template <class T>
__device__ __forceinline__ void kg_attention_bwd_dq(const T* q, const T* k, const T* v, const void* mask,
                                                    const T* dout, const T* lse, const T* dsum, T* dq, T* dmask,
                                                    const KgAttnArgs& a) {
  KG_ATTN_BWD_WARP_LOOP(a.bh * a.sq) {
    const kg_index bh = w / a.sq, i = w - bh * a.sq;
    const kg_index moff = kg_attn_mask_base<T>(a, bh);
    T acc[KG_ATTN_MAX_HEAD / 32];
    for (int e = 0; e < KG_ATTN_MAX_HEAD / 32; ++e) acc[e] = T(0);
    for (kg_index j0 = 0; j0 < a.sk; j0 += 32) {
      const kg_index j = j0 + lane;
      const T p = kg_attn_prob(kg_attn_score(q, k, mask, a, bh, moff, i, j), lse[w]);
      T ds = T(0);
      if (j < a.sk) {
        T dp = T(0);
        for (kg_index c = 0; c < a.dv; ++c) dp += dout[w * a.dv + c] * v[(bh * a.sk + j) * a.dv + c];
        ds = p * (dp - dsum[w]);
        if (dmask) dmask[moff + i * a.mask_sq + j * a.mask_sk] = ds;
      }
      for (int jj = 0; jj < 32; ++jj) {
        const T dsj = __shfl_sync(0xffffffffu, ds, jj);
        if (j0 + jj >= a.sk) break;
        for (int e = 0; e < KG_ATTN_MAX_HEAD / 32; ++e) {
          const kg_index c = lane + 32 * e;
          if (c < a.d) acc[e] += dsj * k[(bh * a.sk + j0 + jj) * a.d + c];
        }
      }
    }
    if (dq)
      for (int e = 0; e < KG_ATTN_MAX_HEAD / 32; ++e) {
        const kg_index c = lane + 32 * e;
        if (c < a.d) dq[w * a.d + c] = acc[e] * (T)a.scale;
      }
  }
}

template <class T>
__device__ __forceinline__ void kg_attention_bwd_dkv(const T* q, const T* k, const T* v, const void* mask,
                                                     const T* dout, const T* lse, const T* dsum, T* dk, T* dv,
                                                     const KgAttnArgs& a) {
  KG_ATTN_BWD_WARP_LOOP(a.bh * a.sk) {
    const kg_index bh = w / a.sk, j = w - bh * a.sk;
    const kg_index moff = kg_attn_mask_base<T>(a, bh);
    T gk[KG_ATTN_MAX_HEAD / 32], gv[KG_ATTN_MAX_HEAD / 32];
    for (int e = 0; e < KG_ATTN_MAX_HEAD / 32; ++e) gk[e] = gv[e] = T(0);
    for (kg_index i0 = 0; i0 < a.sq; i0 += 32) {
      const kg_index i = i0 + lane, row = bh * a.sq + i;
      T p = T(0), ds = T(0);
      if (i < a.sq) {
        p = kg_attn_prob(kg_attn_score(q, k, mask, a, bh, moff, i, j), lse[row]);
        T dp = T(0);
        for (kg_index c = 0; c < a.dv; ++c) dp += dout[row * a.dv + c] * v[w * a.dv + c];
        ds = p * (dp - dsum[row]);
      }
      for (int ii = 0; ii < 32; ++ii) {
        const T pi = __shfl_sync(0xffffffffu, p, ii), dsi = __shfl_sync(0xffffffffu, ds, ii);
        if (i0 + ii >= a.sq) break;
        const kg_index r = bh * a.sq + i0 + ii;
        for (int e = 0; e < KG_ATTN_MAX_HEAD / 32; ++e) {
          const kg_index c = lane + 32 * e;
          if (c < a.dv) gv[e] += pi * dout[r * a.dv + c];
          if (c < a.d) gk[e] += dsi * q[r * a.d + c];
        }
      }
    }
    for (int e = 0; e < KG_ATTN_MAX_HEAD / 32; ++e) {
      const kg_index c = lane + 32 * e;
      if (dv && c < a.dv) dv[w * a.dv + c] = gv[e];
      if (dk && c < a.d) dk[w * a.d + c] = gk[e] * (T)a.scale;
    }
  }
}

extern "C" __global__ void __launch_bounds__(KG_ATTN_THREADS)
    kg_attention_bwd_rows_f32(const float* __restrict__ q, const float* __restrict__ k, const void* __restrict__ mask,
                              const float* __restrict__ out, const float* __restrict__ dout, float* __restrict__ scratch,
                              KgAttnArgs args) {
  kg_attention_bwd_rows<float>(q, k, mask, out, dout, scratch, scratch + args.bh * args.sq, args);
}

extern "C" __global__ void __launch_bounds__(KG_ATTN_THREADS)
    kg_attention_bwd_dq_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                            const void* __restrict__ mask, const float* __restrict__ dout, const float* __restrict__ scratch,
                            float* __restrict__ dq, float* __restrict__ dmask, KgAttnArgs args) {
  kg_attention_bwd_dq<float>(q, k, v, mask, dout, scratch, scratch + args.bh * args.sq, dq, dmask, args);
}

extern "C" __global__ void __launch_bounds__(KG_ATTN_THREADS)
    kg_attention_bwd_dkv_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                             const void* __restrict__ mask, const float* __restrict__ dout, const float* __restrict__ scratch,
                             float* __restrict__ dk, float* __restrict__ dv, KgAttnArgs args) {
  kg_attention_bwd_dkv<float>(q, k, v, mask, dout, scratch, scratch + args.bh * args.sq, dk, dv, args);
}

extern "C" __global__ void __launch_bounds__(KG_ATTN_THREADS)
    kg_attention_bwd_rows_f64(const double* __restrict__ q, const double* __restrict__ k, const void* __restrict__ mask,
                              const double* __restrict__ out, const double* __restrict__ dout, double* __restrict__ scratch,
                              KgAttnArgs args) {
  kg_attention_bwd_rows<double>(q, k, mask, out, dout, scratch, scratch + args.bh * args.sq, args);
}

extern "C" __global__ void __launch_bounds__(KG_ATTN_THREADS)
    kg_attention_bwd_dq_f64(const double* __restrict__ q, const double* __restrict__ k, const double* __restrict__ v,
                            const void* __restrict__ mask, const double* __restrict__ dout, const double* __restrict__ scratch,
                            double* __restrict__ dq, double* __restrict__ dmask, KgAttnArgs args) {
  kg_attention_bwd_dq<double>(q, k, v, mask, dout, scratch, scratch + args.bh * args.sq, dq, dmask, args);
}

extern "C" __global__ void __launch_bounds__(KG_ATTN_THREADS)
    kg_attention_bwd_dkv_f64(const double* __restrict__ q, const double* __restrict__ k, const double* __restrict__ v,
                             const void* __restrict__ mask, const double* __restrict__ dout, const double* __restrict__ scratch,
                             double* __restrict__ dk, double* __restrict__ dv, KgAttnArgs args) {
  kg_attention_bwd_dkv<double>(q, k, v, mask, dout, scratch, scratch + args.bh * args.sq, dk, dv, args);
}
