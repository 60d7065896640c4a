// What the softmax kernels (softmax.cu, softmax_backward.cu) share with ops/softmax.cpp: the
// block size and the row layouts the grids are sized for. Plain C++: included by the kernels and
// by host code alike.
#pragma once

#define KG_SOFTMAX_THREADS 256
// inner == 1: rows of up to KG_SOFTMAX_WARP_MAX elements take a warp each (KG_SOFTMAX_THREADS / 32
// rows per block), longer rows a block each.
#define KG_SOFTMAX_WARP_MAX 1024
// inner > 1: a block takes up to KG_SOFTMAX_COLUMNS adjacent columns, a power of two from 2.
#define KG_SOFTMAX_COLUMNS 32
