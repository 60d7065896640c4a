#include "ops/pool_dnnl.hpp"

#include <memory>
#include <mutex>

#include "kg/error.hpp"
#include "ops/dnnl.hpp"
#include "ops/op_util.hpp"
#include "util/str.hpp"

namespace kg::ops {

namespace {

std::string size2_text(Size2 s) { return s.h == s.w ? util::cat(s.h) : util::cat(s.h, "x", s.w); }

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
    if (in.size() != 1 || in[0] != DType::F32) throw Error("runs on one f32 input only");
    return DType::F32;
  }
  void cpu_forward(CpuContext& ctx) const override {
    const Tensor& x = ctx.inputs[0];
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

bool channels_last_pool_supported(const PoolConfig& c) {
  if (c.kind == PoolConfig::Kind::Global) return true;
  if (!dnnl::available()) return false;
  // PyTorch's average in ceil mode leaves the windows' part past the padded input out of the
  // count, which oneDNN's include-padding average would count: those stay NCHW.
  return !(c.kind == PoolConfig::Kind::Avg && c.ceil_mode);
}

CustomData channels_last_pool(const PoolConfig& c) { return CustomData::make<ChannelsLastPoolOp>(c); }

}  // namespace kg::ops
