// What the normalisation kernels (norm.cu, norm_backward.cu) share with ops/norm.cpp: block
// size, row strategies and the layouts of their scratch buffers. Plain host C++ too.
#pragma once

#define KG_NORM_THREADS 256

// nn.batch_norm2d. Forward scratch: KG_BN_SCALE_SHIFT values per channel (the C scales, then the
// C shifts), then, 8-byte aligned, KG_BN_FWD_PARTIALS doubles per (channel, range) block (count,
// mean, sum of squared deviations). Backward scratch: KG_BN_COEFS values per channel,
// channel-major (A, B, mean, C of dx = A dy + B (x - mean) + C), then KG_BN_BWD_PARTIALS doubles
// per block (count, centre, squared deviations, Σ dy, Σ dy (x - centre)). A channel's M = N*H*W
// values are cut into ranges of at least KG_BN_MIN_CHUNK values, as many as bring the blocks of
// all channels to about KG_BN_TARGET_BLOCKS.
#define KG_BN_SCALE_SHIFT 2
#define KG_BN_COEFS 4
#define KG_BN_FWD_PARTIALS 3
#define KG_BN_BWD_PARTIALS 5
#define KG_BN_MIN_CHUNK 1024
// Loads each thread issues before it adds them into a range's partial sums: single values, or
// 16-byte packs.
#define KG_BN_UNROLL 8
#define KG_BN_PACK_UNROLL 4
#define KG_BN_TARGET_BLOCKS 1024

// nn.layer_norm. Rows of up to KG_LN_WARP_MAX elements take a warp each (KG_NORM_THREADS / 32
// rows per block), longer ones a block. The backward's parameter sums take KG_LN_COLS adjacent
// columns per block; its scratch holds KG_LN_STATS values per row (mean, 1 / std).
#define KG_LN_WARP_MAX 1024
#define KG_LN_COLS 32
#define KG_LN_STATS 2
