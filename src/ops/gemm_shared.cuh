// The tiled GEMM's geometry (gemm.cuh), shared with the host code that sizes its grids
// (ops/linear.cpp, ops/matmul.cpp): 64×64 output tiles, 16-deep k slices, 256 threads each
// computing 4×4. Grid x covers the n tiles, grid y the m tiles. Plain host C++ too.
#pragma once

#define KG_GEMM_BM 64
#define KG_GEMM_BN 64
#define KG_GEMM_BK 16
#define KG_GEMM_THREADS 256
