// Data-parallel training through LoadOptions::process_group: two ranks (threads of this process
// over an in-process group) that each train on half of every batch end where one process training
// on the whole batch ends, whatever the bucket size and with gradients accumulated over two
// backward calls; ranks start from rank 0's parameters; a group of one changes nothing; the file
// rendezvous's collectives and its errors; on a GPU, a one-rank NCCL job matches the plain run.
// The MPI path runs as a program in tests/tools/test_cli_train.cpp.
#include <gtest/gtest.h>

#include <barrier>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "backend/comm/group.hpp"
#include "kg/cuda.hpp"
#include "kg/kg.hpp"
#include "support/test_util.hpp"

namespace {

namespace fs = std::filesystem;
using kg::DType;
using kg::SymTensor;
using kg::Tensor;

// Two ranks in two threads of this process: every collective meets at a barrier, and a sum is
// taken in rank order, so both ranks get the same bits.
struct PairState {
  std::barrier<> meet{2};
  void* data[2] = {nullptr, nullptr};
};

class PairGroup final : public kg::comm::Group {
 public:
  PairGroup(PairState& s, int rank) : s_(s), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return 2; }
  int local_rank() const override { return rank_; }
  const char* transport() const override { return "test-pair"; }
  void broadcast(void* data, std::size_t bytes, int root) override {
    s_.data[rank_] = data;
    s_.meet.arrive_and_wait();
    if (rank_ != root) std::memcpy(data, s_.data[root], bytes);
    s_.meet.arrive_and_wait();
  }
  void all_reduce_sum(double* data, std::size_t n) override { sum<double>(data, n); }
  void barrier() override { s_.meet.arrive_and_wait(); }
  std::unique_ptr<kg::comm::Request> start_all_reduce_sum(void* data, std::size_t count, DType dtype) override {
    ++all_reduces;
    if (dtype == DType::F32)
      sum<float>(static_cast<float*>(data), count);
    else
      sum<double>(static_cast<double*>(data), count);
    return nullptr;  // done already
  }
  int all_reduces = 0;

 private:
  template <class T>
  void sum(T* data, std::size_t n) {
    s_.data[rank_] = data;
    s_.meet.arrive_and_wait();
    std::vector<T> total(n);
    const T* a = static_cast<const T*>(s_.data[0]);
    const T* b = static_cast<const T*>(s_.data[1]);
    for (std::size_t i = 0; i < n; ++i) total[i] = a[i] + b[i];
    s_.meet.arrive_and_wait();  // both have read both
    std::copy(total.begin(), total.end(), data);
  }
  PairState& s_;
  int rank_;
};

// Runs rank_main(1) in a thread and rank_main(0) here, each as one rank of a pair; returns what
// each threw ("" where nothing).
template <class F>
std::vector<std::string> on_two_ranks(F&& rank_main) {
  std::vector<std::string> failure(2);
  auto guarded = [&](int r) {
    try {
      rank_main(r);
    } catch (const std::exception& e) {
      failure[static_cast<std::size_t>(r)] = e.what();
    }
  };
  std::thread t1(guarded, 1);
  guarded(0);
  t1.join();
  return failure;
}

// logits = W2 relu(W1 x + b1) + b2, loss = cross-entropy.
kg::Model mlp() {
  auto [x, g] = SymTensor::input(DType::F32, {kg::Dim::named("batch"), 12}, "x");
  SymTensor labels = g->input(DType::I64, {kg::Dim::named("batch")}, "labels");
  SymTensor h = kg::relu(kg::nn::linear(x, 16, "fc1"), "act");
  SymTensor logits = kg::nn::linear(h, 5, "fc2");
  SymTensor loss = kg::cross_entropy(logits, labels, "loss");
  return kg::Model(g, {{"logits", logits}, {"loss", loss}}, kg::LoweringMode::Training);
}

struct Batch {
  Tensor x, labels;
};
Batch random_batch(std::mt19937_64& rng, std::int64_t n) {
  Batch b{kg_test::random_tensor(rng, DType::F32, {n, 12}), Tensor::empty(DType::I64, {n})};
  std::uniform_int_distribution<std::int64_t> u(0, 4);
  for (std::int64_t i = 0; i < n; ++i) b.labels.data<std::int64_t>()[i] = u(rng);
  return b;
}
// Rows [first, first + n) of t.
Tensor rows(const Tensor& t, std::int64_t first, std::int64_t n) {
  std::vector<std::int64_t> shape = t.shape();
  const std::size_t row = t.nbytes() / static_cast<std::size_t>(shape[0]);
  shape[0] = n;
  Tensor out = Tensor::empty(t.dtype(), shape);
  std::memcpy(out.raw(), static_cast<const char*>(t.raw()) + static_cast<std::size_t>(first) * row, out.nbytes());
  return out;
}

void train_steps(kg::LoadedModel& m, const std::vector<Batch>& batches, std::int64_t first, std::int64_t n) {
  for (const Batch& b : batches) {
    m.zero_grad();
    m.forward({rows(b.x, first, n), rows(b.labels, first, n)});
    m.backward();
    m.step();
  }
}

constexpr std::int64_t kGlobal = 8, kSteps = 4;

TEST(DataParallel, TwoRanksOnHalfBatchesEndWhereOneProcessOnTheWholeBatchEnds) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  std::vector<Batch> batches;
  for (int k = 0; k < kSteps; ++k) batches.push_back(random_batch(rng, kGlobal));
  const kg::Model model = mlp();
  const kg::OptimizerOptions sgd = kg::OptimizerOptions::sgd(0.1, 0.9);
  kg::LoadOptions opt;
  opt.seed = 3;
  opt.threads = 1;
  kg::LoadedModel one = model.load(kg::Device::cpu(), {{kGlobal, 12}, {kGlobal}}, opt);
  one.set_optimizer(sgd);
  one.set_training(true);
  train_steps(one, batches, 0, kGlobal);
  const auto want = one.state_dict();

  // A bucket per gradient (1 byte), a few gradients per bucket, and one bucket for all.
  for (const std::size_t bucket : {std::size_t{1}, std::size_t{300}, std::size_t{25} << 20}) {
    SCOPED_TRACE(testing::Message() << "bucket_bytes " << bucket);
    PairState state;
    std::map<std::string, Tensor> got[2];
    std::map<std::string, Tensor> initial[2];
    int reduces[2] = {0, 0};
    const std::vector<std::string> failure = on_two_ranks([&](int r) {
      auto group = std::make_shared<PairGroup>(state, r);
      kg::LoadOptions o = opt;
      o.seed = opt.seed + static_cast<std::uint64_t>(r) * 1000;  // rank 1's own start is replaced
      o.process_group = std::make_shared<kg::ProcessGroup>(group);
      o.bucket_bytes = bucket;
      kg::LoadedModel m = model.load(kg::Device::cpu(), {{kGlobal / 2, 12}, {kGlobal / 2}}, o);
      initial[r] = m.state_dict();
      m.set_optimizer(sgd);
      m.set_training(true);
      train_steps(m, batches, r * (kGlobal / 2), kGlobal / 2);
      got[r] = m.state_dict();
      reduces[r] = group->all_reduces;
    });
    ASSERT_EQ(failure[0], "");
    ASSERT_EQ(failure[1], "");
    // Four gradients (backward order: fc2.weight 320 bytes, fc2.bias 20, fc1.weight 768, fc1.bias
    // 64): a bucket each; {fc2.weight}, {fc2.bias, fc1.weight}, {fc1.bias}; or one in all.
    const int per_step = bucket == 1 ? 4 : bucket == 300 ? 3 : 1;
    EXPECT_EQ(reduces[0], per_step * kSteps);
    for (const auto& [name, t] : initial[0]) {
      EXPECT_EQ(std::memcmp(t.raw(), initial[1].at(name).raw(), t.nbytes()), 0) << "rank 1 did not start from rank 0's " << name;
      EXPECT_EQ(std::memcmp(got[0].at(name).raw(), got[1].at(name).raw(), t.nbytes()), 0) << "the ranks drifted apart: " << name;
      EXPECT_TRUE(kg_test::all_close(got[0].at(name), want.at(name), 1e-5, 1e-6)) << name;
    }
  }
  // What the test tells apart: without the averaging, rank 0 would train on its half alone.
  kg::LoadedModel half = model.load(kg::Device::cpu(), {{kGlobal / 2, 12}, {kGlobal / 2}}, opt);
  half.set_optimizer(sgd);
  half.set_training(true);
  train_steps(half, batches, 0, kGlobal / 2);
  EXPECT_FALSE(kg_test::all_close(half.state_dict().at("fc1.weight"), want.at("fc1.weight"), 1e-3, 1e-4));
}

// A temporary folder, removed at the end.
struct TempDir {
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "kg-rendezvous-test-XXXXXX").string();
    if (!::mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp failed");
    path = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string path;
};

// Gradients of two backward() calls summed before one step (no zero_grad between): the second
// average adds only the new part's mean, so two ranks still end where one process ends.
TEST(DataParallel, GradientsAccumulatedOverTwoBackwardsStayAveraged) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  std::vector<Batch> batches;
  for (int k = 0; k < 2 * kSteps; ++k) batches.push_back(random_batch(rng, kGlobal));
  const kg::Model model = mlp();
  const kg::OptimizerOptions sgd = kg::OptimizerOptions::sgd(0.05);
  kg::LoadOptions opt;
  opt.seed = 11;
  opt.threads = 1;
  auto accumulate_steps = [&](kg::LoadedModel& m, std::int64_t first, std::int64_t n) {
    for (std::size_t k = 0; k < batches.size(); k += 2) {
      m.zero_grad();
      for (std::size_t j = k; j < k + 2; ++j) {
        m.forward({rows(batches[j].x, first, n), rows(batches[j].labels, first, n)});
        m.backward();
      }
      m.step();
    }
  };
  kg::LoadedModel one = model.load(kg::Device::cpu(), {{kGlobal, 12}, {kGlobal}}, opt);
  one.set_optimizer(sgd);
  one.set_training(true);
  accumulate_steps(one, 0, kGlobal);
  PairState state;
  std::map<std::string, Tensor> got[2];
  const std::vector<std::string> failure = on_two_ranks([&](int r) {
    kg::LoadOptions o = opt;
    o.process_group = std::make_shared<kg::ProcessGroup>(std::make_shared<PairGroup>(state, r));
    kg::LoadedModel m = model.load(kg::Device::cpu(), {{kGlobal / 2, 12}, {kGlobal / 2}}, o);
    m.set_optimizer(sgd);
    m.set_training(true);
    accumulate_steps(m, r * (kGlobal / 2), kGlobal / 2);
    got[r] = m.state_dict();
  });
  ASSERT_EQ(failure[0], "");
  ASSERT_EQ(failure[1], "");
  for (const auto& [name, t] : one.state_dict()) EXPECT_TRUE(kg_test::all_close(got[0].at(name), t, 1e-5, 1e-6)) << name;
}

TEST(DataParallel, AGroupOfOneChangesNothing) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  std::vector<Batch> batches;
  for (int k = 0; k < kSteps; ++k) batches.push_back(random_batch(rng, kGlobal));
  const kg::Model model = mlp();
  kg::LoadOptions opt;
  opt.seed = 5;
  opt.threads = 1;
  kg::LoadedModel plain = model.load(kg::Device::cpu(), {{kGlobal, 12}, {kGlobal}}, opt);
  TempDir dir;
  for (const bool rendezvous : {false, true}) {
    kg::LoadOptions o = opt;
    o.process_group = rendezvous ? std::make_shared<kg::ProcessGroup>(kg::comm::make_rendezvous(dir.path, 0, 1, 0, 5))
                                 : kg::ProcessGroup::single();
    o.bucket_bytes = 100;
    kg::LoadedModel m = model.load(kg::Device::cpu(), {{kGlobal, 12}, {kGlobal}}, o);
    for (kg::LoadedModel* lm : {&plain, &m}) {
      lm->set_optimizer(kg::OptimizerOptions::adamw(1e-2));
      lm->set_training(true);
    }
    plain.load_state_dict(m.state_dict());
    train_steps(plain, batches, 0, kGlobal);
    train_steps(m, batches, 0, kGlobal);
    for (const auto& [name, t] : plain.state_dict())
      EXPECT_EQ(std::memcmp(t.raw(), m.state_dict().at(name).raw(), t.nbytes()), 0) << name;
  }
}

TEST(DataParallel, Errors) {
  // Inference models are not trained.
  auto [x, g] = SymTensor::input(DType::F32, {kg::Dim::named("batch"), 4}, "x");
  kg::Model inference(g, {{"y", kg::relu(x, "r")}});
  kg::LoadOptions o;
  o.process_group = kg::ProcessGroup::single();
  kg_test::expect_error([&] { inference.load(kg::Device::cpu(), {{2, 4}}, o); },
                        {"LoadOptions::process_group", "LoweringMode::Training"});
  o.bucket_bytes = 0;
  kg_test::expect_error([&] { mlp().load(kg::Device::cpu(), {{2, 12}, {2}}, o); }, {"bucket_bytes is 0"});
}

TEST(Rendezvous, TwoRanksBroadcastSumAndMeet) {
  TempDir dir;
  double sums[2][3];
  std::uint64_t got[2] = {0, 0};
  const std::vector<std::string> failure = on_two_ranks([&](int r) {
    auto g = kg::comm::make_rendezvous(dir.path, r, 2, r, 20);
    EXPECT_EQ(g->rank(), r);
    EXPECT_EQ(std::string(g->transport()), "rendezvous");
    std::uint64_t token = r == 1 ? 0x1234'5678'9abc'def0ULL : 0;
    g->broadcast(&token, sizeof token, 1);
    got[r] = token;
    for (int k = 0; k < 3; ++k) sums[r][k] = (r + 1) * 0.1 + k;
    for (int round = 0; round < 5; ++round) g->barrier();  // old generations are cleaned up
    g->all_reduce_sum(sums[r], 3);
    float grad = 1;
    EXPECT_THROW(g->start_all_reduce_sum(&grad, 1, DType::F32), kg::Error);
  });
  ASSERT_EQ(failure[0], "");
  ASSERT_EQ(failure[1], "");
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r], 0x1234'5678'9abc'def0ULL);
    for (int k = 0; k < 3; ++k) EXPECT_EQ(sums[r][k], (0.1 + k) + (0.2 + k));
  }
  // At most the last two generations' files of each rank are left.
  std::size_t files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path)) ++files;
  EXPECT_LE(files, 4u);
}

TEST(Rendezvous, Errors) {
  TempDir dir;
  auto alone = kg::comm::make_rendezvous(dir.path, 0, 2, 0, 0.2);
  kg_test::expect_error([&] { alone->barrier(); }, {"rank 0 waited", "barrier", "rank(s) 1"});
  float grad = 1;
  kg_test::expect_error([&] { alone->start_all_reduce_sum(&grad, 1, DType::F32); }, {"over MPI", "mpirun"});
  kg_test::expect_error([&] { kg::comm::make_rendezvous(dir.path, 2, 2, 0, 1); }, {"rank 2 of 2 ranks"});
  kg_test::expect_error([&] { kg::comm::make_rendezvous(dir.path + "/none", 0, 1, 0, 1); }, {"does not exist"});
  // The environment a launcher sets, mistyped.
  ::setenv("KG_WORLD_SIZE", "2", 1);
  ::setenv("KG_RANK", "5", 1);
  ::setenv("KG_RENDEZVOUS", dir.path.c_str(), 1);
  kg_test::expect_error([] { kg::ProcessGroup::join(); }, {"KG_RANK='5'", "from 0 to 1"});
  ::unsetenv("KG_RENDEZVOUS");
  ::setenv("KG_RANK", "1", 1);
  kg_test::expect_error([] { kg::ProcessGroup::join(); }, {"KG_RENDEZVOUS"});
  ::unsetenv("KG_WORLD_SIZE");
  ::unsetenv("KG_RANK");
  EXPECT_EQ(kg::ProcessGroup::join()->transport(), "single");
}

TEST(DataParallelGpu, OneRankNcclJobMatchesThePlainRun) {
  if (!kg::cuda::available()) GTEST_SKIP() << "no GPU: " << kg::cuda::unavailable_reason();
  std::mt19937_64 rng(kg_test::fresh_seed());
  std::vector<Batch> batches;
  for (int k = 0; k < kSteps; ++k) batches.push_back(random_batch(rng, kGlobal));
  const kg::Model model = mlp();
  kg::LoadOptions opt;
  opt.seed = 7;
  kg::LoadedModel plain = model.load(kg::Device::cuda(), {{kGlobal, 12}, {kGlobal}}, opt);
  TempDir dir;
  kg::LoadOptions o = opt;
  o.process_group = std::make_shared<kg::ProcessGroup>(kg::comm::make_rendezvous(dir.path, 0, 1, 0, 30));
  o.bucket_bytes = 300;  // several buckets
  kg::LoadedModel nccl = model.load(kg::Device::cuda(), {{kGlobal, 12}, {kGlobal}}, o);
  for (kg::LoadedModel* m : {&plain, &nccl}) {
    m->set_optimizer(kg::OptimizerOptions::sgd(0.1, 0.9));
    m->set_training(true);
  }
  train_steps(plain, batches, 0, kGlobal);
  train_steps(nccl, batches, 0, kGlobal);
  const auto init = model.load(kg::Device::cpu(), {{kGlobal, 12}, {kGlobal}}, opt).state_dict();
  for (const auto& [name, t] : plain.state_dict()) {
    EXPECT_TRUE(kg_test::all_close(nccl.state_dict().at(name), t, 1e-6, 1e-7)) << name;
    EXPECT_FALSE(kg_test::all_close(t, init.at(name), 1e-4, 1e-5)) << name << " did not train";
  }
}

}  // namespace
