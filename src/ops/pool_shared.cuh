// What the pooling kernels (pool.cu, pool_backward.cu) share with ops/pool.cpp: the block size
// and the concrete geometry passed by value. Plain host C++ too.
#pragma once

#define KG_POOL_THREADS 256

#include "index_shared.cuh"

// [N, C, H, W] → [N, C, H', W'] seen as N*C planes. Upsampling reads its scale factors from kh
// and kw. The dividers (by H*W, W and the strides) serve the max-pool backward's 32-bit path.
struct KgPoolShape {
  long long planes;  // N * C
  long long h, w, ho, wo;
  long long kh, kw, sh, sw, ph, pw, dh, dw;
  KgDivider hw_div, w_div, sh_div, sw_div;
};

// Channels-last pooling (pool_nhwc.cu): [N, H, W, C] → [N, H', W', C].
struct KgPoolNhwcShape {
  long long n, h, w, c, ho, wo;
  long long kh, kw, sh, sw, ph, pw, dh, dw;
};
