// Image classification data: finding Fashion-MNIST, normalising it, shuffling and batching.
#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

#include "kg/data.hpp"
#include "util/file.hpp"
#include "util/str.hpp"

namespace kg::data {
namespace {

namespace fs = std::filesystem;

constexpr const char* kPackage = "dataset-fashion-mnist";
constexpr std::array<const char*, 4> kStems = {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};

// The file of `stem` in `dir`, gzipped or not; "" when neither exists.
std::string locate(const fs::path& dir, const std::string& stem) {
  for (const std::string& name : {stem + ".gz", stem}) {
    std::error_code ec;
    if (fs::is_regular_file(dir / name, ec)) return (dir / name).string();
  }
  return {};
}

// All four files in `dir`; `origin` says where the folder came from, for errors.
FashionMnistFiles files_in(const fs::path& dir, const std::string& origin) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw Error(util::cat("Fashion-MNIST folder '", dir.string(), "' (", origin, ") does not exist"));
  FashionMnistFiles f;
  f.dir = dir.string();
  std::string* slots[] = {&f.train_images, &f.train_labels, &f.test_images, &f.test_labels};
  std::vector<std::string> missing;
  for (std::size_t i = 0; i < kStems.size(); ++i) {
    *slots[i] = locate(dir, kStems[i]);
    if (slots[i]->empty()) missing.push_back(util::cat(kStems[i], "[.gz]"));
  }
  if (!missing.empty())
    throw Error(util::cat("Fashion-MNIST folder '", dir.string(), "' (", origin, ") lacks ",
                          util::join(missing, ", ")));
  return f;
}

// The folder dpkg's file list of the package names for the training images; "" if none.
std::string folder_from_dpkg() {
  const char* info = std::getenv("KG_DPKG_INFO_DIR");
  const fs::path dir = info && *info ? info : "/var/lib/dpkg/info";
  for (const std::string& list : {util::cat(kPackage, ".list"), util::cat(kPackage, ":all.list")}) {
    // The guarded read: a FIFO or folder in the list's place (KG_DPKG_INFO_DIR) is skipped, never
    // waited on or read as text (a folder made std::ifstream throw basic_filebuf::underflow).
    std::string text;
    if (!util::try_read_file(dir / list, {std::uint64_t(64) << 20, true}, text)) continue;
    std::istringstream f(text);
    std::string line;
    while (std::getline(f, line)) {
      const std::string want = util::cat("/", kStems[0], ".gz");
      if (line.size() > want.size() && line.compare(line.size() - want.size(), want.size(), want) == 0)
        return fs::path(line).parent_path().string();
    }
  }
  return {};
}

std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [0, bound) without modulo bias (rejection of the low remainder).
std::uint64_t uniform_below(std::mt19937_64& rng, std::uint64_t bound) {
  const std::uint64_t threshold = (0 - bound) % bound;
  for (;;) {
    const std::uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

bool is_integer(DType t) {
  return t == DType::U8 || t == DType::I8 || t == DType::I16 || t == DType::I32 || t == DType::I64;
}

}  // namespace

FashionMnistFiles find_fashion_mnist(const std::string& dir) {
  if (!dir.empty()) return files_in(dir, "given folder");
  if (const char* env = std::getenv("KG_FASHION_MNIST_DIR"); env && *env)
    return files_in(env, "from KG_FASHION_MNIST_DIR");
  const std::string from_dpkg = folder_from_dpkg();
  if (!from_dpkg.empty())
    return files_in(from_dpkg, util::cat("from the ", kPackage, " package's file list"));
  throw Error(util::cat("Fashion-MNIST not found: install the Debian package ", kPackage,
                        " (apt-get install ", kPackage,
                        ", which scripts/install-deps does), or set KG_FASHION_MNIST_DIR to a folder "
                        "holding ",
                        util::join(kStems, ".gz, "), ".gz"));
}

ImageDataset ImageDataset::from_idx(const Tensor& images, const Tensor& labels, const std::string& what,
                                    double mean, double std) {
  if (images.dtype() != DType::U8)
    throw Error(util::cat(what, ": images must be u8 pixels, got ", dtype_name(images.dtype())));
  if (!(images.rank() == 3 || (images.rank() == 4 && images.dim(1) == 1)))
    throw Error(
        util::cat(what, ": images must be [N, H, W] or [N, 1, H, W], got ", sizes_to_string(images.shape())));
  if (labels.rank() != 1 || !is_integer(labels.dtype()))
    throw Error(util::cat(what, ": labels must be integers [N], got ", dtype_name(labels.dtype()), " ",
                          sizes_to_string(labels.shape())));
  const std::int64_t n = images.dim(0);
  if (labels.dim(0) != n)
    throw Error(util::cat(what, ": ", n, " images but ", labels.dim(0), " labels; the counts must agree"));
  if (!(std > 0)) throw Error(util::cat(what, ": the normalisation std must be positive, got ", std));
  const std::int64_t h = images.dim(images.rank() - 2), w = images.dim(images.rank() - 1);

  ImageDataset d;
  d.images_ = Tensor::empty(DType::F32, {n, 1, h, w});
  std::array<float, 256> lut{};
  for (int p = 0; p < 256; ++p)
    lut[static_cast<std::size_t>(p)] = static_cast<float>((p / 255.0 - mean) / std);
  const auto* src = images.data<std::uint8_t>();
  float* dst = d.images_.data<float>();
  for (std::int64_t i = 0; i < images.numel(); ++i) dst[i] = lut[src[i]];

  d.labels_ = Tensor::empty(DType::I64, {n});
  std::int64_t* lab = d.labels_.data<std::int64_t>();
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = labels.item(i);
    if (v < 0) throw Error(util::cat(what, ": label ", i, " is ", v, "; labels must be >= 0"));
    lab[i] = static_cast<std::int64_t>(v);
    d.num_classes_ = std::max(d.num_classes_, lab[i] + 1);
  }
  d.reset_order();
  return d;
}

ImageDataset ImageDataset::load(const std::string& images_path, const std::string& labels_path, double mean,
                                double std) {
  return from_idx(read_idx(images_path), read_idx(labels_path),
                  util::cat("'", images_path, "' with '", labels_path, "'"), mean, std);
}

ImageDataset ImageDataset::fashion_mnist(Split split, const std::string& dir) {
  const FashionMnistFiles f = find_fashion_mnist(dir);
  return split == Split::Train ? load(f.train_images, f.train_labels) : load(f.test_images, f.test_labels);
}

void ImageDataset::truncate(std::int64_t n) {
  if (n < 0) throw Error(util::cat("ImageDataset::truncate: n must be >= 0, got ", n));
  if (n >= size()) {
    reset_order();
    return;
  }
  const std::int64_t per = images_.numel() / std::max<std::int64_t>(size(), 1);
  Tensor im = Tensor::empty(DType::F32, {n, images_.dim(1), images_.dim(2), images_.dim(3)});
  std::memcpy(im.raw(), images_.raw(), static_cast<std::size_t>(n * per) * sizeof(float));
  Tensor lab = Tensor::empty(DType::I64, {n});
  std::memcpy(lab.raw(), labels_.raw(), static_cast<std::size_t>(n) * sizeof(std::int64_t));
  images_ = im;
  labels_ = lab;
  num_classes_ = 0;
  for (std::int64_t i = 0; i < n; ++i)
    num_classes_ = std::max(num_classes_, labels_.data<std::int64_t>()[i] + 1);
  reset_order();
}

void ImageDataset::shuffle(std::uint64_t seed) { order_ = permutation(size(), seed); }

void ImageDataset::reset_order() {
  order_.resize(static_cast<std::size_t>(size()));
  std::iota(order_.begin(), order_.end(), std::int64_t{0});
}

std::int64_t ImageDataset::num_batches(std::int64_t batch_size, bool drop_last) const {
  if (batch_size <= 0) throw Error(util::cat("batch size must be positive, got ", batch_size));
  return drop_last ? size() / batch_size : (size() + batch_size - 1) / batch_size;
}

Batch ImageDataset::batch(std::int64_t index, std::int64_t batch_size) const {
  const std::int64_t count = num_batches(batch_size, false);
  if (index < 0 || index >= count)
    throw Error(util::cat("batch ", index, " of size ", batch_size, " is out of range: ", size(),
                          " examples make ", count, " batches"));
  const std::int64_t h = height(), w = width(), per = h * w;
  Batch b;
  b.images = Tensor::zeros(DType::F32, {batch_size, 1, h, w});
  b.labels = Tensor::zeros(DType::I64, {batch_size});
  const std::int64_t first = index * batch_size;
  b.real = std::min(batch_size, size() - first);
  const float* src = images_.data<float>();
  const std::int64_t* lab = labels_.data<std::int64_t>();
  float* dst = b.images.data<float>();
  std::int64_t* out_lab = b.labels.data<std::int64_t>();
  for (std::int64_t r = 0; r < b.real; ++r) {
    const std::int64_t e = order_[static_cast<std::size_t>(first + r)];
    std::memcpy(dst + r * per, src + e * per, static_cast<std::size_t>(per) * sizeof(float));
    out_lab[r] = lab[e];
  }
  return b;
}

std::vector<std::int64_t> permutation(std::int64_t n, std::uint64_t seed) {
  if (n < 0) throw Error(util::cat("permutation: n must be >= 0, got ", n));
  std::vector<std::int64_t> p(static_cast<std::size_t>(n));
  std::iota(p.begin(), p.end(), std::int64_t{0});
  std::mt19937_64 rng(seed);
  for (std::int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(uniform_below(rng, static_cast<std::uint64_t>(i) + 1));
    std::swap(p[static_cast<std::size_t>(i)], p[static_cast<std::size_t>(j)]);
  }
  return p;
}

std::uint64_t epoch_seed(std::uint64_t seed, std::int64_t epoch) {
  return splitmix64(splitmix64(seed) ^ splitmix64(0xD1B54A32D192ED03ull + static_cast<std::uint64_t>(epoch)));
}

}  // namespace kg::data
