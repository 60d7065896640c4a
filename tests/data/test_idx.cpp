// The IDX reader and writer: round trips of files the test writes byte by byte (plain and
// gzipped), and every malformed case.
#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "kg/data.hpp"
#include "support/test_util.hpp"
#include "util/memory.hpp"

namespace fs = std::filesystem;
using kg_test::expect_error;

namespace {

class Idx : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "kg-idx-test-XXXXXX").string();
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

using Bytes = std::vector<unsigned char>;

void put_be(Bytes& b, std::uint64_t v, int width) {
  for (int i = width - 1; i >= 0; --i) b.push_back(static_cast<unsigned char>((v >> (8 * i)) & 0xFF));
}

// An IDX file built by hand: magic, type code, dims, then each element big-endian.
Bytes idx_bytes(unsigned char type, const std::vector<std::uint32_t>& dims, const Bytes& payload_be) {
  Bytes b{0, 0, type, static_cast<unsigned char>(dims.size())};
  for (auto d : dims) put_be(b, d, 4);
  b.insert(b.end(), payload_be.begin(), payload_be.end());
  return b;
}

void write_plain(const std::string& path, const Bytes& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

void write_gz(const std::string& path, const Bytes& b) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  if (!b.empty()) {
    ASSERT_EQ(gzwrite(f, b.data(), static_cast<unsigned>(b.size())), static_cast<int>(b.size()));
  }
  ASSERT_EQ(gzclose(f), Z_OK);
}

Bytes read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

struct Case {
  unsigned char code;
  kg::DType dtype;
  int width;
};
const Case kCases[] = {{0x08, kg::DType::U8, 1},  {0x09, kg::DType::I8, 1},  {0x0B, kg::DType::I16, 2},
                       {0x0C, kg::DType::I32, 4}, {0x0D, kg::DType::F32, 4}, {0x0E, kg::DType::F64, 8}};

// Random values of a dtype as raw host bits (the reference) and the big-endian payload.
void random_payload(std::mt19937_64& rng, const Case& c, std::int64_t n, std::vector<std::uint64_t>* bits,
                    Bytes* payload) {
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint64_t v = rng();
    if (c.dtype == kg::DType::F32) {
      const float f = std::uniform_real_distribution<float>(-1e3f, 1e3f)(rng);
      std::uint32_t u;
      std::memcpy(&u, &f, 4);
      v = u;
    } else if (c.dtype == kg::DType::F64) {
      const double d = std::uniform_real_distribution<double>(-1e6, 1e6)(rng);
      std::memcpy(&v, &d, 8);
    } else if (c.width < 8) {
      v &= (std::uint64_t{1} << (8 * c.width)) - 1;
    }
    bits->push_back(v);
    put_be(*payload, v, c.width);
  }
}

std::uint64_t element_bits(const kg::Tensor& t, std::int64_t i, int width) {
  std::uint64_t v = 0;
  std::memcpy(&v, static_cast<const unsigned char*>(t.raw()) + i * width, static_cast<std::size_t>(width));
  return v;  // little-endian host: the low `width` bytes
}

}  // namespace

TEST_F(Idx, ReadsHandWrittenFilesOfEveryTypePlainAndGzipped) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<std::vector<std::uint32_t>> shapes = {{7}, {3, 5}, {2, 3, 4}, {2, 1, 3, 2}, {0, 4}};
  for (const Case& c : kCases)
    for (const auto& dims : shapes)
      for (bool gz : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << kg::dtype_name(c.dtype) << " rank " << dims.size() << (gz ? " gz" : ""));
        std::int64_t n = 1;
        for (auto d : dims) n *= d;
        std::vector<std::uint64_t> bits;
        Bytes payload;
        random_payload(rng, c, n, &bits, &payload);
        const std::string p = path(gz ? "f.idx.gz" : "f.idx");
        const Bytes file = idx_bytes(c.code, dims, payload);
        if (gz)
          write_gz(p, file);
        else
          write_plain(p, file);
        const kg::Tensor t = kg::data::read_idx(p);
        ASSERT_EQ(t.dtype(), c.dtype);
        ASSERT_EQ(t.rank(), dims.size());
        for (std::size_t d = 0; d < dims.size(); ++d) EXPECT_EQ(t.dim(d), dims[d]);
        ASSERT_EQ(t.numel(), n);
        for (std::int64_t i = 0; i < n; ++i)
          ASSERT_EQ(element_bits(t, i, c.width), bits[static_cast<std::size_t>(i)]) << "element " << i;
      }
}

TEST_F(Idx, WriterProducesTheFormatAndRoundTrips) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const Case& c : kCases) {
    SCOPED_TRACE(kg::dtype_name(c.dtype));
    std::vector<std::uint64_t> bits;
    Bytes payload;
    random_payload(rng, c, 2 * 3 * 5, &bits, &payload);
    kg::Tensor t = kg::Tensor::empty(c.dtype, {2, 3, 5});
    for (std::int64_t i = 0; i < t.numel(); ++i)
      std::memcpy(static_cast<unsigned char*>(t.raw()) + i * c.width, &bits[static_cast<std::size_t>(i)],
                  static_cast<std::size_t>(c.width));
    kg::data::write_idx(path("w.idx"), t);
    EXPECT_EQ(read_all(path("w.idx")), idx_bytes(c.code, {2, 3, 5}, payload));
    kg::data::write_idx(path("w.idx.gz"), t, /*gzip=*/true);
    const Bytes gz = read_all(path("w.idx.gz"));
    ASSERT_GE(gz.size(), 2u);
    EXPECT_EQ(gz[0], 0x1F);
    EXPECT_EQ(gz[1], 0x8B);
    const kg::Tensor back = kg::data::read_idx(path("w.idx.gz"));
    ASSERT_EQ(back.shape(), t.shape());
    ASSERT_EQ(back.dtype(), t.dtype());
    EXPECT_EQ(std::memcmp(back.raw(), t.raw(), t.nbytes()), 0);
  }
  expect_error([&] { kg::data::write_idx(path("x.idx"), kg::Tensor::zeros(kg::DType::I64, {3})); },
               {"x.idx", "i64"});
  expect_error([&] { kg::data::write_idx(path("x.idx"), kg::Tensor::zeros(kg::DType::U8, {})); },
               {"x.idx", "1 to 255 dims"});
}

TEST_F(Idx, RejectsMalformedFiles) {
  const Bytes good_payload(2 * 3, 7);
  struct Bad {
    const char* name;
    Bytes bytes;
    std::vector<std::string> parts;
  };
  Bytes no_dims = idx_bytes(0x08, {}, {});
  Bytes short_dims{0, 0, 0x08, 3, 0, 0, 0, 2, 0, 0, 0, 3};
  Bytes huge = idx_bytes(0x0E, {1u << 20, 1u << 20}, {});
  Bytes overflow = idx_bytes(0x08, {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}, {});
  Bytes longer = idx_bytes(0x08, {2, 3}, Bytes(9, 1));
  const std::vector<Bad> cases = {
      {"empty", {}, {"too short for an IDX header", "0 bytes"}},
      {"two_bytes", {0, 0}, {"too short for an IDX header", "2 bytes"}},
      {"magic", idx_bytes(0x08, {2, 3}, good_payload), {}},  // patched below
      {"type", idx_bytes(0x0A, {2, 3}, good_payload), {"unknown element type 0x0A"}},
      {"no_dims", no_dims, {"0 dims"}},
      {"short_dims", short_dims, {"header ends inside the dims", "3 dims need 12 bytes", "has 8"}},
      {"shorter",
       idx_bytes(0x0C, {2, 3}, Bytes(23, 1)),
       {"payload shorter than the dims say", "[2, 3] of i32", "need 24 bytes", "has 23"}},
      {"longer", longer, {"payload longer than the dims say", "need 6 bytes", "has 9", "3 extra"}},
      {"huge", huge, {"absurd dims", "[1048576, 1048576] of f64"}},
      {"overflow", overflow, {"absurd dims", "more than 2^64"}},
  };
  for (const Bad& b : cases) {
    for (bool gz : {false, true}) {
      SCOPED_TRACE(::testing::Message() << b.name << (gz ? " gz" : ""));
      Bytes bytes = b.bytes;
      std::vector<std::string> parts = b.parts;
      if (std::string(b.name) == "magic") {
        bytes[0] = 0x08;
        bytes[1] = 0x03;
        parts = {"bad magic 0x08 0x03 0x08 0x02"};
      }
      if (gz && std::string(b.name) == "shorter") parts = {"payload shorter", "decompressed data has 23"};
      if (gz && std::string(b.name) == "longer")
        parts = {"payload longer", "decompressed data has 9", "3 extra"};
      const std::string p = path(std::string(b.name) + (gz ? ".gz" : ""));
      if (gz)
        write_gz(p, bytes);
      else
        write_plain(p, bytes);
      parts.insert(parts.begin(), "IDX file '" + p + "'");
      expect_error([&] { kg::data::read_idx(p); }, parts);
    }
  }
  expect_error([&] { kg::data::read_idx(path("missing.idx")); }, {"missing.idx", "no such file"});
  expect_error([&] { kg::data::read_idx(dir_); }, {dir_, "is a folder"});
}

TEST_F(Idx, RejectsTruncatedAndCorruptGzipStreams) {
  const auto seed = kg_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Bytes payload(64 * 64);
  for (auto& v : payload) v = static_cast<unsigned char>(rng() % 7);  // compressible, several blocks of data
  const std::string whole = path("whole.gz");
  write_gz(whole, idx_bytes(0x08, {64, 64}, payload));
  const Bytes gz = read_all(whole);
  ASSERT_GT(gz.size(), 40u);
  // Cut inside the deflate data, and just before the 8-byte trailer (CRC and length).
  for (std::size_t cut : {gz.size() / 2, gz.size() - 4}) {
    SCOPED_TRACE("cut at " + std::to_string(cut) + " of " + std::to_string(gz.size()));
    const std::string p = path("cut.gz");
    write_plain(p, Bytes(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(cut)));
    expect_error([&] { kg::data::read_idx(p); }, {"IDX file '" + p + "'", "truncated gzip stream"});
  }
  // A wrong CRC in the trailer.
  Bytes bad = gz;
  bad[bad.size() - 6] ^= 0x5A;
  const std::string p = path("crc.gz");
  write_plain(p, bad);
  expect_error([&] { kg::data::read_idx(p); }, {"IDX file '" + p + "'", "corrupt gzip stream"});
  // The whole file still reads.
  const kg::Tensor t = kg::data::read_idx(whole);
  ASSERT_EQ(t.numel(), 64 * 64);
  EXPECT_EQ(std::memcmp(t.raw(), payload.data(), payload.size()), 0);
}

TEST_F(Idx, RejectsDimsNoGzipFileCouldHold) {
  // 10^10 bytes of u8 payload in a gzip file of a few dozen bytes: deflate cannot do that.
  const std::string p = path("bomb.gz");
  write_gz(p, idx_bytes(0x08, {100000, 100000}, {}));
  expect_error([&] { kg::data::read_idx(p); },
               {"IDX file '" + p + "'", "absurd dims", "[100000, 100000] of u8"});
}

// The finding: a gzip bomb within the deflate ratio (a 64 MiB payload from a file of a few dozen
// kilobytes) was allocated whole without a memory check, so a file claiming more than the machine
// has was OOM-killed instead of refused. The limit is faked low here; the same file reads without it.
TEST_F(Idx, AGzipBombMeetsTheMemoryCheckBeforeAllocating) {
  const std::string p = path("bomb.gz");
  write_gz(p, idx_bytes(0x08, {8192, 8192}, Bytes(std::size_t{8192} * 8192, 0)));
  kg::util::set_available_memory_for_testing(std::uint64_t{16} << 20);
  expect_error([&] { kg::data::read_idx(p); }, {"IDX file '" + p + "'", "67108864 bytes", "available", "KG_NO_MEMORY_CHECK"});
  kg::util::set_available_memory_for_testing(std::nullopt);
  EXPECT_EQ(kg::data::read_idx(p).numel(), 8192 * 8192);
}

// The finding: write_idx opened its path with std::ofstream / gzopen, which follow a link planted
// there (and replace a device node's content). Both forms now go through the safe write.
TEST_F(Idx, WriterFollowsNoPlantedLink) {
  const std::string victim = path("victim"), link = path("link.idx");
  { std::ofstream(victim) << "keep"; }
  fs::create_symlink(victim, link);
  const kg::Tensor t = kg::Tensor::zeros(kg::DType::U8, {2, 2});
  for (const bool gz : {false, true}) {
    SCOPED_TRACE(gz);
    expect_error([&] { kg::data::write_idx(link, t, gz); }, {link, "symbolic link"});
    std::ifstream in(victim);
    EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()), "keep");
  }
  kg::data::write_idx(path("ok.idx.gz"), t, true);
  EXPECT_EQ(kg::data::read_idx(path("ok.idx.gz")).numel(), 4);
}
