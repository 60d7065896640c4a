// The image dataset: normalisation, count checks, batches (dropped and padded), seeded
// shuffling, finding Fashion-MNIST, and the real files when the Debian package is installed.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <set>

#include "kg/data.hpp"
#include "support/test_util.hpp"

namespace fs = std::filesystem;
using kg_test::expect_error;

namespace {

// Sets an environment variable for the lifetime of the object (unset: nullptr), then restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

class Dataset : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "kg-data-test-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }
  std::string dir_;
};

kg::Tensor random_pixels(std::mt19937_64& rng, std::vector<std::int64_t> shape) {
  kg::Tensor t = kg::Tensor::empty(kg::DType::U8, std::move(shape));
  for (std::int64_t i = 0; i < t.numel(); ++i)
    t.data<std::uint8_t>()[i] = static_cast<std::uint8_t>(rng() & 0xFF);
  return t;
}

kg::Tensor random_labels(std::mt19937_64& rng, std::int64_t n, int classes) {
  kg::Tensor t = kg::Tensor::empty(kg::DType::U8, {n});
  for (std::int64_t i = 0; i < n; ++i) t.data<std::uint8_t>()[i] = static_cast<std::uint8_t>(rng() % classes);
  return t;
}

}  // namespace

TEST_F(Dataset, NormalisesImagesAndWidensLabels) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const kg::Tensor px = random_pixels(rng, {5, 4, 3});
  const kg::Tensor lab = random_labels(rng, 5, 10);
  const auto d = kg::data::ImageDataset::from_idx(px, lab, "test data");
  ASSERT_EQ(d.size(), 5);
  ASSERT_EQ(d.images().dtype(), kg::DType::F32);
  ASSERT_EQ(d.images().shape(), (std::vector<std::int64_t>{5, 1, 4, 3}));
  ASSERT_EQ(d.labels().dtype(), kg::DType::I64);
  ASSERT_EQ(d.labels().shape(), (std::vector<std::int64_t>{5}));
  EXPECT_EQ(d.height(), 4);
  EXPECT_EQ(d.width(), 3);
  for (std::int64_t i = 0; i < px.numel(); ++i) {
    const double want = (px.data<std::uint8_t>()[i] / 255.0 - 0.2860) / 0.3530;
    ASSERT_NEAR(d.images().data<float>()[i], want, 1e-6 * (1 + std::abs(want))) << "pixel " << i;
  }
  std::int64_t max_label = 0;
  for (std::int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(d.labels().data<std::int64_t>()[i], lab.data<std::uint8_t>()[i]);
    max_label = std::max<std::int64_t>(max_label, lab.data<std::uint8_t>()[i]);
  }
  EXPECT_EQ(d.num_classes(), max_label + 1);
  // [N, 1, H, W] images and other integer label types are taken too; other statistics apply.
  const kg::Tensor px4 = px.reshaped({5, 1, 4, 3});
  kg::Tensor lab32 = kg::Tensor::from_vector<std::int32_t>({5}, {0, 1, 2, 3, 4});
  const auto d2 = kg::data::ImageDataset::from_idx(px4, lab32, "test data", 0.5, 0.25);
  EXPECT_NEAR(d2.images().data<float>()[0], (px.data<std::uint8_t>()[0] / 255.0 - 0.5) / 0.25, 1e-5);
  EXPECT_EQ(d2.labels().data<std::int64_t>()[4], 4);
}

TEST_F(Dataset, RejectsBadInputs) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  const kg::Tensor px = random_pixels(rng, {5, 4, 3});
  expect_error([&] { kg::data::ImageDataset::from_idx(px, random_labels(rng, 4, 10), "my files"); },
               {"my files", "5 images but 4 labels"});
  expect_error(
      [&] { kg::data::ImageDataset::from_idx(px.to(kg::DType::F32), random_labels(rng, 5, 10), "my files"); },
      {"my files", "u8", "f32"});
  expect_error(
      [&] {
        kg::data::ImageDataset::from_idx(px.reshaped({5, 12}), random_labels(rng, 5, 10), "my files");
      },
      {"my files", "[N, H, W]", "[5, 12]"});
  expect_error(
      [&] { kg::data::ImageDataset::from_idx(px, kg::Tensor::zeros(kg::DType::F32, {5}), "my files"); },
      {"my files", "labels must be integers", "f32"});
  expect_error(
      [&] {
        kg::data::ImageDataset::from_idx(px, kg::Tensor::from_vector<std::int8_t>({5}, {0, 1, -2, 3, 4}),
                                         "f");
      },
      {"label 2 is -2"});
  // Files whose counts disagree, read from disk: the error names both files.
  kg::data::write_idx(path("img.idx"), px);
  kg::data::write_idx(path("lab.idx.gz"), random_labels(rng, 6, 10), true);
  expect_error([&] { kg::data::ImageDataset::load(path("img.idx"), path("lab.idx.gz")); },
               {path("img.idx"), path("lab.idx.gz"), "5 images but 6 labels"});
}

TEST_F(Dataset, BatchesDropOrPadTheLastOne) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::int64_t n = 11;
  const kg::Tensor px = random_pixels(rng, {n, 2, 3});
  auto d = kg::data::ImageDataset::from_idx(px, random_labels(rng, n, 10), "t");
  EXPECT_EQ(d.num_batches(4, /*drop_last=*/true), 2);
  EXPECT_EQ(d.num_batches(4, /*drop_last=*/false), 3);
  EXPECT_EQ(d.num_batches(11, true), 1);
  EXPECT_EQ(d.num_batches(12, true), 0);
  expect_error([&] { d.num_batches(0, true); }, {"batch size must be positive", "0"});
  d.shuffle(seed);
  const auto& order = d.order();
  for (std::int64_t k = 0; k < 3; ++k) {
    const kg::data::Batch b = d.batch(k, 4);
    ASSERT_EQ(b.images.shape(), (std::vector<std::int64_t>{4, 1, 2, 3}));
    ASSERT_EQ(b.labels.shape(), (std::vector<std::int64_t>{4}));
    EXPECT_EQ(b.real, k < 2 ? 4 : 3);
    for (std::int64_t r = 0; r < 4; ++r) {
      const bool real = r < b.real;
      const std::int64_t e = real ? order[static_cast<std::size_t>(k * 4 + r)] : -1;
      for (std::int64_t j = 0; j < 6; ++j) {
        const float got = b.images.data<float>()[r * 6 + j];
        const float want = real ? d.images().data<float>()[e * 6 + j] : 0.0f;
        ASSERT_EQ(got, want) << "batch " << k << " row " << r << " pixel " << j;
      }
      EXPECT_EQ(b.labels.data<std::int64_t>()[r], real ? d.labels().data<std::int64_t>()[e] : 0);
    }
  }
  expect_error([&] { d.batch(3, 4); }, {"batch 3", "out of range", "11 examples make 3 batches"});
  // Truncation keeps the first examples in file order.
  d.truncate(5);
  EXPECT_EQ(d.size(), 5);
  EXPECT_EQ(d.order(), (std::vector<std::int64_t>{0, 1, 2, 3, 4}));
  const kg::data::Batch b = d.batch(0, 5);
  for (std::int64_t j = 0; j < 5 * 6; ++j)
    ASSERT_FLOAT_EQ(b.images.data<float>()[j], (px.data<std::uint8_t>()[j] / 255.0 - 0.2860) / 0.3530);
}

TEST(Shuffle, PermutationIsReproducibleAndUniform) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (std::int64_t n : {0, 1, 2, 17, 1000}) {
    const auto p = kg::data::permutation(n, seed);
    ASSERT_EQ(static_cast<std::int64_t>(p.size()), n);
    auto sorted = p;
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::int64_t> iota(static_cast<std::size_t>(n));
    std::iota(iota.begin(), iota.end(), std::int64_t{0});
    EXPECT_EQ(sorted, iota) << "not a permutation of 0.." << n - 1;
    EXPECT_EQ(kg::data::permutation(n, seed), p) << "same seed, different order";
  }
  EXPECT_NE(kg::data::permutation(1000, seed), kg::data::permutation(1000, seed + 1));
  // Fixed across runs and builds: mt19937_64 is specified by the standard and the draws are ours.
  EXPECT_EQ(kg::data::permutation(10, 0), (std::vector<std::int64_t>{7, 2, 0, 8, 3, 9, 6, 1, 5, 4}));
  // Each of the 6 orders of 3 elements is about equally likely (chi-square, 5 degrees of freedom;
  // 30 is far beyond the 0.9999 quantile 25.7).
  std::map<std::vector<std::int64_t>, int> counts;
  const int trials = 6000;
  for (int t = 0; t < trials; ++t)
    ++counts[kg::data::permutation(3, seed * 7919 + static_cast<std::uint64_t>(t))];
  ASSERT_EQ(counts.size(), 6u);
  double chi2 = 0;
  for (const auto& [perm, c] : counts) chi2 += (c - trials / 6.0) * (c - trials / 6.0) / (trials / 6.0);
  EXPECT_LT(chi2, 30.0);
}

TEST(Shuffle, EpochSeedsDifferPerEpochAndRun) {
  std::set<std::uint64_t> seen;
  for (std::uint64_t s : {0ull, 1ull, 42ull})
    for (std::int64_t e = 1; e <= 50; ++e) seen.insert(kg::data::epoch_seed(s, e));
  EXPECT_EQ(seen.size(), 150u);
  EXPECT_EQ(kg::data::epoch_seed(7, 3), kg::data::epoch_seed(7, 3));
}

TEST_F(Dataset, ShuffledOrderIsTheSeedsPermutation) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  auto d = kg::data::ImageDataset::from_idx(random_pixels(rng, {9, 2, 2}), random_labels(rng, 9, 3), "t");
  d.shuffle(123);
  EXPECT_EQ(d.order(), kg::data::permutation(9, 123));
  d.reset_order();
  EXPECT_EQ(d.order(), (std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
}

TEST_F(Dataset, FindsFashionMnistFolders) {
  std::mt19937_64 rng(kg_test::fresh_seed());
  const fs::path data = fs::path(dir_) / "fmnist";
  fs::create_directories(data);
  // Two files gzipped, two plain: both are found.
  kg::data::write_idx((data / "train-images-idx3-ubyte.gz").string(), random_pixels(rng, {6, 28, 28}), true);
  kg::data::write_idx((data / "train-labels-idx1-ubyte").string(), random_labels(rng, 6, 10));
  kg::data::write_idx((data / "t10k-images-idx3-ubyte").string(), random_pixels(rng, {3, 28, 28}));
  expect_error([&] { kg::data::find_fashion_mnist(data.string()); },
               {data.string(), "lacks t10k-labels-idx1-ubyte[.gz]"});
  kg::data::write_idx((data / "t10k-labels-idx1-ubyte.gz").string(), random_labels(rng, 3, 10), true);
  const auto f = kg::data::find_fashion_mnist(data.string());
  EXPECT_EQ(f.dir, data.string());
  EXPECT_EQ(f.train_images, (data / "train-images-idx3-ubyte.gz").string());
  EXPECT_EQ(f.train_labels, (data / "train-labels-idx1-ubyte").string());
  EXPECT_EQ(f.test_images, (data / "t10k-images-idx3-ubyte").string());
  EXPECT_EQ(f.test_labels, (data / "t10k-labels-idx1-ubyte.gz").string());
  const auto test = kg::data::ImageDataset::fashion_mnist(kg::data::Split::Test, data.string());
  EXPECT_EQ(test.size(), 3);
  expect_error([&] { kg::data::find_fashion_mnist((data / "nope").string()); }, {"nope", "does not exist"});

  // The environment variable, then dpkg's file list of the package (a fake one here).
  {
    ScopedEnv env("KG_FASHION_MNIST_DIR", data.string().c_str());
    EXPECT_EQ(kg::data::find_fashion_mnist().dir, data.string());
  }
  const fs::path info = fs::path(dir_) / "dpkg-info";
  fs::create_directories(info);
  ScopedEnv no_env("KG_FASHION_MNIST_DIR", nullptr);
  ScopedEnv dpkg("KG_DPKG_INFO_DIR", info.string().c_str());
  expect_error([&] { kg::data::find_fashion_mnist(); },
               {"Fashion-MNIST not found", "dataset-fashion-mnist", "KG_FASHION_MNIST_DIR"});
  // A folder or a FIFO in place of the list: skipped (a folder gave libstdc++'s
  // basic_filebuf::underflow, a FIFO waited forever).
  fs::create_directories(info / "dataset-fashion-mnist.list");
  ASSERT_EQ(::mkfifo((info / "dataset-fashion-mnist:all.list").c_str(), 0600), 0);
  expect_error([&] { kg::data::find_fashion_mnist(); }, {"Fashion-MNIST not found"});
  fs::remove(info / "dataset-fashion-mnist.list");
  {
    std::ofstream list(info / "dataset-fashion-mnist.list");
    list << "/.\n/usr\n" << data.string() << "\n" << (data / "train-images-idx3-ubyte.gz").string() << "\n";
  }
  EXPECT_EQ(kg::data::find_fashion_mnist().dir, data.string());
}

TEST(FashionMnist, RealFilesFromTheDebianPackage) {
  kg::data::FashionMnistFiles files;
  try {
    files = kg::data::find_fashion_mnist();
  } catch (const kg::Error& e) {
    GTEST_SKIP() << "Fashion-MNIST is not installed: " << e.what();
  }
  const auto train = kg::data::ImageDataset::load(files.train_images, files.train_labels);
  const auto test = kg::data::ImageDataset::load(files.test_images, files.test_labels);
  ASSERT_EQ(train.size(), 60000);
  ASSERT_EQ(test.size(), 10000);
  EXPECT_EQ(train.images().shape(), (std::vector<std::int64_t>{60000, 1, 28, 28}));
  EXPECT_EQ(test.images().shape(), (std::vector<std::int64_t>{10000, 1, 28, 28}));
  for (const auto* d : {&train, &test}) {
    std::vector<std::int64_t> per_class(10, 0);
    for (std::int64_t i = 0; i < d->size(); ++i) {
      const std::int64_t l = d->labels().data<std::int64_t>()[i];
      ASSERT_GE(l, 0);
      ASSERT_LE(l, 9);
      ++per_class[static_cast<std::size_t>(l)];
    }
    // Fashion-MNIST is balanced: 6000 and 1000 images per class.
    for (std::int64_t c : per_class) EXPECT_EQ(c, d->size() / 10);
  }
  // The normalisation constants are the training set's statistics.
  double sum = 0, sq = 0;
  const float* px = train.images().data<float>();
  for (std::int64_t i = 0; i < train.images().numel(); ++i) {
    sum += px[i];
    sq += static_cast<double>(px[i]) * px[i];
  }
  const double n = static_cast<double>(train.images().numel());
  const double mean = sum / n, stddev = std::sqrt(sq / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(stddev, 1.0, 0.01);
}
