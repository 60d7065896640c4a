#include "support/fusion_util.hpp"

#include <gtest/gtest.h>

#include "support/test_util.hpp"

namespace kg_test {

int count_ops(const kg::Model& m, bool views) {
  int n = 0;
  for (int id : m.live_nodes()) {
    const kg::Node& node = m.graph().node(id);
    n += node.kind == kg::Node::Kind::Op && (views || !node.op->op().is_view());
  }
  return n;
}

std::vector<kg::Tensor> random_inputs(std::mt19937_64& rng, const std::vector<std::vector<std::int64_t>>& shapes,
                                      kg::DType dt, double lo, double hi) {
  std::vector<kg::Tensor> v;
  for (const auto& s : shapes) v.push_back(random_tensor(rng, dt, s, lo, hi));
  return v;
}

void expect_fused_matches_plain(const kg::Model& fused, const kg::Model& plain,
                                const std::vector<std::vector<std::int64_t>>& shapes,
                                const std::vector<kg::Tensor>& inputs, double tol,
                                const std::map<std::string, kg::Tensor>& params) {
  kg::LoadOptions poisoned;
  poisoned.poison_buffers = true;
  kg::LoadOptions checked;
  checked.checked = true;
  kg::LoadedModel lp = plain.load(kg::Device::cpu(), shapes, poisoned);
  kg::LoadedModel lc = fused.load(kg::Device::cpu(), shapes, poisoned);
  kg::LoadedModel le = fused.load(kg::Device::cpu(), shapes, checked);
  if (!params.empty()) {
    lp.load_state_dict(params);
    lc.load_state_dict(params);
    le.load_state_dict(params);
  }
  const auto want = lp.forward(inputs), got_cpu = lc.forward(inputs), got_emu = le.forward(inputs);
  ASSERT_EQ(got_cpu.size(), want.size());
  ASSERT_EQ(got_emu.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("output " + std::to_string(i) + " '" + fused.outputs()[i].first + "'");
    EXPECT_TRUE(all_written(got_cpu[i]));
    EXPECT_TRUE(all_written(got_emu[i]));
    EXPECT_TRUE(all_close(got_cpu[i], want[i], tol, tol));
    EXPECT_TRUE(all_close(got_emu[i], want[i], tol, tol));
  }
}

}  // namespace kg_test
