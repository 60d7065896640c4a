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
// few-channel path's input patch, weights and k table (ops/conv_gpu.cpp lays them out within it).
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
  // block (a multiple of OCB), tiles across and down, channel chunks per group. The tensor-core
  // kernel's few-channel path uses tile_h, tile_w (tile_h · tile_w = KG_IG_BM), tiles_w, tiles_h.
  long long tile_h, tile_w, cc, och, tiles_w, tiles_h, chunks;
  // 1: channels-last tensors (x [N, H, W, C], y and the residual [N, OH, OW, O]); the weights
  // stay [O, C/groups, kh, kw]
  long long nhwc;
  // channels-last library path: the input channels cuDNN sees (c, or c padded with zeros)
  long long cpad;
  // channels-last GEMM form: the im2col rows' length (kh·kw·c rounded up to 8), or 0; nhwc_mma:
  // the weights' rows (see gemm_c)
  long long gemm_k;
  // the channels of one tap in the k order (k = (ky·kw + kx)·gemm_c + channel) of the GEMM form's
  // rows and of nhwc_mma's weights: c, or c rounded up to even on the few-channel path (the
  // padding channel's weights are zero)
  long long gemm_c;
  // nhwc_mma with few input channels (c not a multiple of 8), or patch_w = 0 for the general
  // gather. A block computes patch_tiles tiles of tile_h × tile_w output pixels one after the
  // other; for each it stages the input patch their windows cover, [patch_h][patch_w][gemm_c]
  // (zero outside the image and in the padding channel), at the start of its shared memory. Its
  // weights [KG_IG_BN][patch_ldb] start at byte patch_b, its k table at byte patch_k. All chosen
  // by ops/conv_gpu.cpp.
  long long patch_w, patch_h, patch_tiles, patch_ldb, patch_b, patch_k;
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
