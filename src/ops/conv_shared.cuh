// What the convolution kernels (conv.cu, conv_backward.cu) and their host side (conv_gpu.cpp)
// share: launch constants and the geometry structs passed by value. Given to NVRTC and the
// emulator as an in-memory header and included by the host as plain C++, so it holds only
// macros and plain structs of 64-bit integers, and includes nothing.
#pragma once

// ---- forward (conv.cu) ----

// Threads per block of every forward kernel.
#define KG_CONV_THREADS 256
// gemm: an output tile of BM channels × BN pixels per block, reduced over BK-deep k slices.
#define KG_CONV_BM 64
#define KG_CONV_BN 64
#define KG_CONV_BK 16
// nhwc_mma (tensor cores): an output tile of BM pixels × BN channels per block, reduced over
// BK-deep k slices.
#define KG_IG_BM 128
#define KG_IG_BN 64
#define KG_IG_BK 32
// Its static shared memory in bytes: the general path's two slices of A and B (30 KB), or the
// few-channel path's input patch, weights and k table (ops/conv_gpu.cpp keeps them within it).
#define KG_IG_SMEM 36864
// tiled: the input window at the start of dynamic shared memory is rounded up to this many
// bytes; the weights after it are read as vectors.
#define KG_CONV_SMEM_ALIGN 16

// The channels-last library path's scratch (ops/conv_gpu.cpp): each part starts at a multiple
// of this many bytes.
#define KG_CONV_SCRATCH_ALIGN 256

// The concrete geometry of a forward launch.
struct KgConvShape {
  long long n, c, h, w;      // input (n: the launch's images)
  long long o, ho, wo;       // output channels and size
  long long kh, kw;          // kernel
  long long sh, sw, ph, pw;  // stride, padding
  long long dh, dw;          // dilation
  long long groups;
  long long ocb;  // direct: output channels per thread (1, 2 or 4)
  // tiled: output tile rows and columns, input channels staged at a time, output channels per
  // block (a multiple of OCB), tiles across and down, channel chunks per group
  long long tile_h, tile_w, cc, och, tiles_w, tiles_h, chunks;
  // 1: channels-last tensors (x [N, H, W, C], y and the residual [N, OH, OW, O]); the weights
  // stay [O, C/groups, kh, kw]
  long long nhwc;
  // channels-last library path: the input channels cuDNN sees (c, or c padded with zeros)
  long long cpad;
  // channels-last GEMM form: the im2col rows' length (kh·kw·c rounded up to 8), or 0
  long long gemm_k;
  // nhwc_mma with few input channels: the input patch's width in pixels (the block's tile is part
  // of one output row, staged with its window in shared memory), or 0 for the general gather
  long long patch_w;
};

// ---- backward (conv_backward.cu) ----

// Threads per block of every backward kernel.
#define KG_CONV_BWD_THREADS 256

// The concrete geometry of the backward launches.
struct KgConvGradShape {
  long long n, c, h, w;      // input
  long long o, ho, wo;       // output channels and size
  long long kh, kw;          // kernel
  long long sh, sw, ph, pw;  // stride, padding
  long long dh, dw;          // dilation
  long long groups;
};
