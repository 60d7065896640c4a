// yolo.detect_decode: turns a detection head's per-anchor box distances into boxes.
//
// Input  [B, 4, A]: for each anchor a, the distances (left, top, right, bottom) from the anchor
//                   point to the box sides, in grid cells.
// Output [B, 4, A]: (centre x, centre y, width, height) in pixels.
//
// The op holds configuration, not tensors: the anchor grid (cell centres) and the stride of
// each anchor, plus the kernel's block size. The three arrays reach the kernel as the op's
// parameters (CustomOp::parameters), initialised from these values and not trainable.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kg/kg.hpp"
#include "kg/runtime_op.hpp"

namespace yolo {

// The kernel. One thread per (batch, anchor); blocks tile the anchors of one batch entry, so the
// grid is flat over batch × anchor tiles.
inline const char* kDetectDecodeSource = R"(
extern "C" __global__ void detect_decode(const float* __restrict__ dist, float* __restrict__ boxes,
                                         const float* __restrict__ anchor_x, const float* __restrict__ anchor_y,
                                         const float* __restrict__ strides, int A, int tiles_per_batch) {
  const int b = blockIdx.x / tiles_per_batch;
  const int a = (blockIdx.x % tiles_per_batch) * blockDim.x + threadIdx.x;
  if (a >= A) return;
  const float* d = dist + (long long)b * 4 * A;
  float* o = boxes + (long long)b * 4 * A;
  const float l = d[a], t = d[A + a], r = d[2 * A + a], btm = d[3 * A + a];
  const float s = strides[a];
  const float x1 = anchor_x[a] - l, y1 = anchor_y[a] - t, x2 = anchor_x[a] + r, y2 = anchor_y[a] + btm;
  o[a] = 0.5f * (x1 + x2) * s;
  o[A + a] = 0.5f * (y1 + y2) * s;
  o[2 * A + a] = (x2 - x1) * s;
  o[3 * A + a] = (y2 - y1) * s;
}
)";

// Launch-time half: argument packing and grid. The parameters arrive in t.params, in the
// order of DetectDecodeOp::parameters().
class DetectDecodeRuntime final : public kg::RuntimeOp {
 public:
  explicit DetectDecodeRuntime(int block_a) : block_a_(block_a) {}

  void pack_args(const kg::LaunchTensors& t, kg::ArgVisitor& v) const override {
    const auto a = static_cast<std::int32_t>(t.output.shape[2]);
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.output.ptr);
    v.pointer(t.params[0].ptr);
    v.pointer(t.params[1].ptr);
    v.pointer(t.params[2].ptr);
    v.i32(a);
    v.i32(tiles(a));
  }
  kg::Dim3 block() const override { return {static_cast<unsigned>(block_a_), 1, 1}; }
  kg::Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    return {static_cast<unsigned>(shape[0] * tiles(shape[2])), 1, 1};
  }

 private:
  std::int32_t tiles(std::int64_t a) const { return static_cast<std::int32_t>((a + block_a_ - 1) / block_a_); }
  int block_a_;
};

// Graph-level half: name, shape inference, parameters, lowering, and a CPU implementation.
class DetectDecodeOp final : public kg::CustomOp {
 public:
  DetectDecodeOp(std::vector<float> anchor_x, std::vector<float> anchor_y, std::vector<float> strides,
                 int block_a = 128)
      : ax_(std::move(anchor_x)), ay_(std::move(anchor_y)), strides_(std::move(strides)), block_a_(block_a) {
    if (ax_.size() != ay_.size() || ax_.size() != strides_.size())
      throw kg::Error("yolo.detect_decode: anchor_x, anchor_y and strides must have one entry per anchor");
    if (block_a_ <= 0 || block_a_ > 1024) throw kg::Error("yolo.detect_decode: block size must be in 1..1024");
  }

  // Builds the anchor grid of one feature level: cell centres of an h × w map, all with `stride`.
  static std::shared_ptr<DetectDecodeOp> for_level(int h, int w, float stride, int block_a = 128) {
    std::vector<float> ax, ay, st;
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x) {
        ax.push_back(static_cast<float>(x) + 0.5f);
        ay.push_back(static_cast<float>(y) + 0.5f);
        st.push_back(stride);
      }
    return std::make_shared<DetectDecodeOp>(ax, ay, st, block_a);
  }

  std::string name() const override { return "yolo.detect_decode"; }
  std::string attributes() const override {
    return "anchors=" + std::to_string(ax_.size()) + " block=" + std::to_string(block_a_);
  }

  // boxes [B, 4, A] → [B, 4, A]: shape-preserving, once the input is checked.
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override {
    if (in.size() != 1) throw kg::Error("takes one input");
    const kg::Shape& s = in[0];
    if (s.rank() != 3 || (s[1].is_static() && s[1].size() != 4) ||
        (s[2].is_static() && s[2].size() != static_cast<std::int64_t>(ax_.size())))
      throw kg::Error("expects [B, 4, " + std::to_string(ax_.size()) + "], got " + s.to_string());
    return s;
  }
  kg::DType infer_output_dtype(const std::vector<kg::DType>& in) const override {
    if (in.at(0) != kg::DType::F32) throw kg::Error("supports f32 only");
    return in[0];
  }

  // One value per anchor each: the anchor points and strides, constants of the op.
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>&) const override {
    const auto a = static_cast<std::int64_t>(ax_.size());
    return {{"anchor_x", {a}, kg::DType::F32, kg::ParamInit::from_values(ax_), false},
            {"anchor_y", {a}, kg::DType::F32, kg::ParamInit::from_values(ay_), false},
            {"strides", {a}, kg::DType::F32, kg::ParamInit::from_values(strides_), false}};
  }

  std::optional<kg::Lowered> lower(const kg::LowerContext&) const override {
    return kg::Lowered{"yolo.detect_decode", kDetectDecodeSource, "detect_decode",
                       std::make_shared<DetectDecodeRuntime>(block_a_)};
  }

  void cpu_forward(kg::CpuContext& ctx) const override {
    const kg::Tensor& in = ctx.inputs[0];
    const std::int64_t B = in.dim(0), A = in.dim(2);
    const float* d = in.data<float>();
    float* o = ctx.output.data<float>();
    // The parameters, as the kernel gets them (loaded weights replace the op's initial values).
    const float* pax = ctx.params[0].data<float>();
    const float* pay = ctx.params[1].data<float>();
    const float* pst = ctx.params[2].data<float>();
    ctx.parallel_for(B * A, 1024, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) {
        const std::int64_t b = i / A, a = i % A;
        const float* db = d + b * 4 * A;
        float* ob = o + b * 4 * A;
        const float s = pst[a], ax = pax[a], ay = pay[a];
        const float x1 = ax - db[a], y1 = ay - db[A + a], x2 = ax + db[2 * A + a], y2 = ay + db[3 * A + a];
        ob[a] = 0.5f * (x1 + x2) * s;
        ob[A + a] = 0.5f * (y1 + y2) * s;
        ob[2 * A + a] = (x2 - x1) * s;
        ob[3 * A + a] = (y2 - y1) * s;
      }
    });
  }

 private:
  std::vector<float> ax_, ay_, strides_;
  int block_a_;
};

}  // namespace yolo
