// How a reduction kernel (softmax.cu, norm.cu, reduce_ops.cu) reads element k of its data input:
// through a loader, a device functor ld(k). The unfused entries pass KgLoadPtr, the input in
// memory; a reduction with a folded prologue (ops/fused_reduction) passes a generated struct that
// computes the element from the prologue's inputs instead.
#pragma once

#include "kg_device.cuh"

template <class T>
struct KgLoadPtr {
  const T* p;
  __device__ __forceinline__ T operator()(kg_index k) const { return p[k]; }
};

template <class T>
__device__ __forceinline__ KgLoadPtr<T> kg_load_ptr(const T* p) {
  KgLoadPtr<T> l;
  l.p = p;
  return l;
}
