// Training data: the IDX file format (MNIST's), plain or gzip-compressed, and an image
// classification dataset (Fashion-MNIST) with seeded shuffling and batches.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kg/tensor.hpp"

namespace kg::data {

// Reads an IDX file: two zero bytes, a type byte (0x08 u8, 0x09 i8, 0x0B i16, 0x0C i32, 0x0D f32,
// 0x0E f64), the number of dims, one big-endian u32 per dim, then the big-endian payload. A
// gzip-compressed file is recognised by its first bytes. Throws kg::Error naming the file and the
// problem: a bad magic, an unknown type, absurd dims, a payload shorter or longer than the dims
// say, a truncated or corrupt gzip stream.
Tensor read_idx(const std::string& path);

// Writes `t` (u8, i8, i16, i32, f32 or f64, rank 1 to 255) as an IDX file, gzip-compressed when
// `gzip` is set.
void write_idx(const std::string& path, const Tensor& t, bool gzip = false);

// The four files of Fashion-MNIST (or MNIST, which has the same names).
struct FashionMnistFiles {
  std::string dir;
  std::string train_images, train_labels, test_images, test_labels;
};

// Finds Fashion-MNIST: in `dir` when given, else in $KG_FASHION_MNIST_DIR when set, else where
// Debian's dataset-fashion-mnist package put it (its dpkg file list). Each file may be
// gzip-compressed ("train-images-idx3-ubyte.gz") or not. Throws kg::Error naming the missing
// files, or the package to install when nothing is found.
FashionMnistFiles find_fashion_mnist(const std::string& dir = "");

// Which half of the data set.
enum class Split { Train, Test };

// A batch of examples: images f32 [B, 1, H, W], labels i64 [B]; rows at and after `real` are
// padding (zero images, label 0).
struct Batch {
  Tensor images;
  Tensor labels;
  std::int64_t real = 0;
};

// Images normalised to f32 [N, 1, H, W] as (pixel / 255 - mean) / std, and labels i64 [N], with
// an order of the examples that shuffle() permutes.
class ImageDataset {
 public:
  // Fashion-MNIST's training-set pixel statistics.
  static constexpr double kMean = 0.2860, kStd = 0.3530;

  ImageDataset() = default;
  // From IDX tensors: images u8 [N, H, W] (or [N, 1, H, W]) and integer labels [N], each >= 0.
  // `what` names the source in errors (e.g. the file names).
  static ImageDataset from_idx(const Tensor& images, const Tensor& labels, const std::string& what,
                               double mean = kMean, double std = kStd);
  // Reads an image file and a label file (IDX, plain or gzipped).
  static ImageDataset load(const std::string& images_path, const std::string& labels_path,
                           double mean = kMean, double std = kStd);
  // One split of Fashion-MNIST, found as find_fashion_mnist(dir) does.
  static ImageDataset fashion_mnist(Split split, const std::string& dir = "");

  std::int64_t size() const { return labels_.numel(); }
  std::int64_t height() const { return images_.rank() == 4 ? images_.dim(2) : 0; }
  std::int64_t width() const { return images_.rank() == 4 ? images_.dim(3) : 0; }
  // Largest label + 1 (0 for an empty set).
  std::int64_t num_classes() const { return num_classes_; }
  const Tensor& images() const { return images_; }
  const Tensor& labels() const { return labels_; }

  // Keeps the first n examples (n >= size(): all of them); the order starts over.
  void truncate(std::int64_t n);
  // Visits the examples in permutation(size(), seed) order from now on.
  void shuffle(std::uint64_t seed);
  // Visits the examples in file order.
  void reset_order();
  const std::vector<std::int64_t>& order() const { return order_; }

  // Batches of `batch_size` per pass: with `drop_last` the incomplete last batch is left out
  // (training), otherwise it is counted (evaluation).
  std::int64_t num_batches(std::int64_t batch_size, bool drop_last) const;
  // Batch `index` in the current order. A batch that runs past the end is padded to
  // `batch_size` rows and says how many are real.
  Batch batch(std::int64_t index, std::int64_t batch_size) const;

 private:
  Tensor images_, labels_;
  std::vector<std::int64_t> order_;
  std::int64_t num_classes_ = 0;
};

// A permutation of 0..n-1 by Fisher-Yates with std::mt19937_64 seeded with `seed` (the same on
// every run and platform).
std::vector<std::int64_t> permutation(std::int64_t n, std::uint64_t seed);

// The shuffle seed of epoch `epoch` (1-based) of a run seeded with `seed`: a resumed run
// shuffles each epoch as an uninterrupted one does.
std::uint64_t epoch_seed(std::uint64_t seed, std::int64_t epoch);

}  // namespace kg::data
