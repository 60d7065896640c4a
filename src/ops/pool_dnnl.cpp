#include "ops/pool_dnnl.hpp"

#include <memory>
#include <mutex>

#include "kg/error.hpp"
#include "ops/dnnl.hpp"
#include "ops/gpu_util.hpp"
#include "ops/op_util.hpp"
#include "ops/pool_shared.cuh"
#include "util/str.hpp"

namespace kg::ops {

namespace {

std::string size2_text(Size2 s) { return s.h == s.w ? util::cat(s.h) : util::cat(s.h, "x", s.w); }

// One launch of pool_nhwc.cu's entry for the op's kind: a thread per output element.
class ChannelsLastPoolRuntime final : public RuntimeOp {
 public:
  ChannelsLastPoolRuntime(PoolConfig c, DType dtype) : c_(c), dtype_(dtype) {}
  void pack_args(const LaunchTensors& t, ArgVisitor& v) const override {
    const auto& in = t.inputs.at(0).shape;
    const auto& out = t.output.shape;
    v.pointer(t.inputs[0].ptr);
    v.pointer(t.output.ptr);
    if (c_.kind == PoolConfig::Kind::Global) {
      v.i64(in[0]);
      v.i64(in[1] * in[2]);
      v.i64(in[3]);
      return;
    }
    const KgPoolNhwcShape s{in[0],       in[1],       in[2],       in[3],        out[1],       out[2],
                            c_.kernel.h, c_.kernel.w, c_.stride.h, c_.stride.w,  c_.padding.h, c_.padding.w,
                            c_.dilation.h, c_.dilation.w};
    v.bytes(&s, sizeof s);
    if (c_.kind == PoolConfig::Kind::Avg) v.i32(c_.count_include_pad ? 1 : 0);
  }
  Dim3 block() const override { return {KG_POOL_THREADS, 1, 1}; }
  // The max pool's threads take 16 bytes of channels each where the channel count allows.
  Dim3 grid(const std::vector<std::int64_t>& shape) const override {
    const std::int64_t pack = 16 / static_cast<std::int64_t>(dtype_size(dtype_));
    const bool packed = c_.kind == PoolConfig::Kind::Max && shape.at(3) % pack == 0;
    return grid_1d(numel_of(shape) / (packed ? pack : 1), KG_POOL_THREADS);
  }

 private:
  PoolConfig c_;
  DType dtype_;
};

class ChannelsLastPoolOp final : public CustomOp {
 public:
  explicit ChannelsLastPoolOp(PoolConfig c) : c_(c) {}
  std::string name() const override {
    switch (c_.kind) {
      case PoolConfig::Kind::Max:
        return "nn.max_pool2d_nhwc";
      case PoolConfig::Kind::Avg:
        return "nn.avg_pool2d_nhwc";
      case PoolConfig::Kind::Global:
        break;
    }
    return "nn.global_avg_pool_nhwc";
  }
  std::string attributes() const override {
    std::string s;
    if (c_.kind != PoolConfig::Kind::Global) {
      s = util::cat("k=", size2_text(c_.kernel), " s=", size2_text(c_.stride), " p=", size2_text(c_.padding));
      if (c_.dilation.h != 1 || c_.dilation.w != 1) s += " d=" + size2_text(c_.dilation);
      if (c_.ceil_mode) s += " ceil_mode=true";
      if (c_.kind == PoolConfig::Kind::Avg && !c_.count_include_pad) s += " count_include_pad=false";
      s += " ";
    }
    s += "layout=nhwc";
    std::lock_guard<std::mutex> lock(mu_);
    if (pool_) s += " impl=onednn:" + pool_->impl();
    return s;
  }
  // [N, H, W, C] → [N, H', W', C] (global: [N, 1, 1, C]).
  Shape infer_output_shape(const std::vector<Shape>& in) const override {
    require_inputs(in, 1);
    const Shape& x = in[0];
    require_rank(x, 4, "[N, H, W, C]");
    if (c_.kind == PoolConfig::Kind::Global) return Shape{x[0], Dim(1), Dim(1), x[3]};
    return Shape{
        x[0],
        window_out(x[1], c_.kernel.h, c_.stride.h, c_.padding.h, c_.dilation.h, c_.ceil_mode, "input height"),
        window_out(x[2], c_.kernel.w, c_.stride.w, c_.padding.w, c_.dilation.w, c_.ceil_mode, "input width"),
        x[3]};
  }
  DType infer_output_dtype(const std::vector<DType>& in) const override {
    if (in.size() != 1 || !(in[0] == DType::F32 || is_half_float(in[0])))
      throw Error("runs on one f32, f16 or bf16 input only");
    return in[0];
  }
  // pool_nhwc.cu's kernel for the node's dtype.
  std::optional<Lowered> lower(const LowerContext& ctx) const override {
    const char* stem = c_.kind == PoolConfig::Kind::Max   ? "kg_max_pool2d_nhwc"
                       : c_.kind == PoolConfig::Kind::Avg ? "kg_avg_pool2d_nhwc"
                                                          : "kg_global_avg_pool_nhwc";
    return Lowered{name(), kernel_file("pool_nhwc.cu"), entry_for(stem, ctx.output_dtype),
                   std::make_shared<ChannelsLastPoolRuntime>(c_, ctx.output_dtype)};
  }
  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
    if (x.dtype() != DType::F32)
      throw Error(util::cat("runs f32 only on the CPU, got ", dtype_name(x.dtype()),
                            "; the channels-last pass rewrites 16-bit pooling for the GPU alone"));
    const auto in = x.shape();
    const auto out = ctx.output.shape();
    const float* src = x.data<float>();
    float* dst = ctx.output.data<float>();
    if (c_.kind == PoolConfig::Kind::Global) {
      // The mean over H*W rows of C channels: each image's rows summed into one row.
      const std::int64_t n = in[0], hw = in[1] * in[2], c = in[3];
      const float inv = hw > 0 ? 1.0f / static_cast<float>(hw) : 0.0f;
      ctx.parallel_for(n, 1, [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t i = b; i < e; ++i) {
          float* o = dst + i * c;
          for (std::int64_t k = 0; k < c; ++k) o[k] = 0.0f;
          for (std::int64_t p = 0; p < hw; ++p) {
            const float* row = src + (i * hw + p) * c;
            for (std::int64_t k = 0; k < c; ++k) o[k] += row[k];
          }
          for (std::int64_t k = 0; k < c; ++k) o[k] *= inv;
        }
      });
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!pool_ || bound_ != in) {
      dnnl::PoolShape s;
      s.kind = c_.kind == PoolConfig::Kind::Max
                   ? dnnl::PoolShape::Kind::Max
                   : (c_.count_include_pad ? dnnl::PoolShape::Kind::AvgIncludePad
                                           : dnnl::PoolShape::Kind::AvgExcludePad);
      s.n = in[0], s.h = in[1], s.w = in[2], s.c = in[3];
      s.kh = c_.kernel.h, s.kw = c_.kernel.w, s.sh = c_.stride.h, s.sw = c_.stride.w;
      s.ph = c_.padding.h, s.pw = c_.padding.w, s.dh = c_.dilation.h, s.dw = c_.dilation.w;
      s.oh = out[1], s.ow = out[2];
      pool_ = std::make_unique<dnnl::Pool>(s);
      bound_ = in;
    }
    pool_->run(src, dst);
  }

 private:
  PoolConfig c_;
  mutable std::mutex mu_;
  mutable std::unique_ptr<dnnl::Pool> pool_;
  mutable std::vector<std::int64_t> bound_;
};

}  // namespace

bool channels_last_pool_supported(const PoolConfig& c, bool gpu) {
  if (c.kind == PoolConfig::Kind::Global) return true;
  if (!gpu && !dnnl::available()) return false;
  // PyTorch's average in ceil mode leaves the windows' part past the padded input out of the
  // count, which oneDNN's include-padding average would count: those stay NCHW.
  return !(c.kind == PoolConfig::Kind::Avg && c.ceil_mode);
}

CustomData channels_last_pool(const PoolConfig& c) { return CustomData::make<ChannelsLastPoolOp>(c); }

}  // namespace kg::ops
