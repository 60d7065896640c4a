// What the loss kernels (loss.cu) share with ops/loss.cpp: the block size. Plain C++: included by
// the kernels and by host code alike.
#pragma once

// Threads per block of every loss kernel; the forward kernels run as one such block.
#define KG_LOSS_THREADS 256
