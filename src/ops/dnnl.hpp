// oneDNN (Debian's libdnnl, linked when the build found it) for the CPU's f32 convolutions and
// pooling on channels-last tensors ([N, H, W, C]), where its kernels run near the cores' FMA
// peak. The op classes that use it (conv_dnnl.cpp, pool_dnnl.cpp) exist only in graphs that the
// channels-last pass rewrote at load; nothing else sees oneDNN. Without the library,
// available() is false and the pass leaves graphs alone.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace kg::ops::dnnl {

// True when the build has oneDNN and its CPU engine starts here.
bool available();
// Why available() is false ("" when it is true).
const std::string& unavailable_reason();

// A counter that the runtime advances whenever it writes parameters in place on the CPU
// (LoadedModel::load_state_dict and what calls it). Ops that keep a converted copy of their
// weights compare it to know when to convert again.
std::uint64_t parameters_generation();
void parameters_changed();

// An activation that oneDNN applies inside the convolution (its eltwise post-op).
enum class Act : std::uint8_t { None, Relu, LeakyRelu, Silu, GeluErf, GeluTanh, Sigmoid, Tanh, Clip };

struct ConvShape {
  std::int64_t n = 0, c = 0, h = 0, w = 0;  // input [n, h, w, c]
  std::int64_t o = 0, kh = 0, kw = 0;       // weight [o, c / groups, kh, kw]
  std::int64_t sh = 1, sw = 1, ph = 0, pw = 0, dh = 1, dw = 1, groups = 1;
  std::int64_t oh = 0, ow = 0;  // output [n, oh, ow, o]
  bool residual = false;        // dst = act(conv + bias + residual)
  Act act = Act::None;
  float alpha = 0.f, beta = 0.f;  // LeakyRelu's slope; Clip's bounds
  // Time each of oneDNN's implementations for this shape at the first run and keep the fastest
  // (otherwise its first choice): LoadOptions::tune.
  bool tune = false;
};

// One convolution on f32 channels-last tensors, with its weights kept in oneDNN's layout.
class Conv {
 public:
  // Throws kg::Error naming the shape when oneDNN has no implementation for it.
  explicit Conv(const ConvShape& s);
  ~Conv();
  Conv(const Conv&) = delete;
  Conv& operator=(const Conv&) = delete;

  // Takes the weights [o, c/groups, kh, kw] with output channel o scaled by scale[o] (scale may
  // be null: 1) and the bias [o] (null: 0), converted into the primitive's layout.
  void set_weights(const float* oihw, const float* scale, const float* bias);
  // dst = act(conv(src) + bias [+ residual]); set_weights must have been called. With
  // ConvShape::tune, the first call times the candidates on these buffers first.
  void run(const float* src, const float* residual, float* dst);
  // The implementation oneDNN picked ("brgconv:avx512_core"), or the fastest when tuned, with
  // the candidates' times ("jit_1x1:avx2, tuned: jit_1x1:avx2 8.3 ms, brgconv_1x1:avx512_core
  // 10.4 ms").
  std::string impl() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct PoolShape {
  enum class Kind : std::uint8_t { Max, AvgIncludePad, AvgExcludePad };
  Kind kind = Kind::Max;
  std::int64_t n = 0, c = 0, h = 0, w = 0;  // input [n, h, w, c]
  std::int64_t kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0, dh = 1, dw = 1;
  std::int64_t oh = 0, ow = 0;  // output [n, oh, ow, c]; padding past ph/pw at the far side
                                // is what the output size needs (ceil mode)
};

// One pooling on f32 channels-last tensors.
class Pool {
 public:
  explicit Pool(const PoolShape& s);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  void run(const float* src, float* dst);
  std::string impl() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kg::ops::dnnl
