// safetensors read/write: round trips for every dtype, the byte layout, files written the way
// scripts/gen-fixtures writes them, and every kind of malformed file.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "support/test_util.hpp"

using kg_test::expect_error;
using kg_test::fresh_seed;

namespace {

namespace fs = std::filesystem;

// A fresh directory under the temporary directory, removed with the object.
struct TempDir {
  fs::path dir;
  TempDir() {
    dir = fs::temp_directory_path() /
          ("kg_st_" + std::to_string(::getpid()) + "_" + std::to_string(fresh_seed()));
    fs::create_directories(dir);
  }
  ~TempDir() { fs::remove_all(dir); }
  std::string path(const std::string& name) const { return (dir / name).string(); }
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Rewrites a file of the same size in place (no truncation: cheaper on file systems that discard
// freed blocks).
void overwrite_bytes(const std::string& path, const std::string& bytes) {
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::string le64(std::uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return s;
}

// A file: length, header (padded with spaces to 8 bytes when `pad`, like the Python writers), data.
std::string file_bytes(std::string header, const std::string& data, bool pad = true) {
  if (pad)
    while (header.size() % 8 != 0) header.push_back(' ');
  return le64(header.size()) + header + data;
}

std::string raw_of(const void* p, std::size_t n) { return std::string(static_cast<const char*>(p), n); }

template <class T>
std::string raw_values(const std::vector<T>& v) {
  return raw_of(v.data(), v.size() * sizeof(T));
}

// A tensor of `dt` with random bytes (bool: 0 or 1).
kg::Tensor random_bytes(std::mt19937_64& rng, kg::DType dt, std::vector<std::int64_t> shape) {
  kg::Tensor t = kg::Tensor::empty(dt, std::move(shape));
  auto* p = static_cast<unsigned char*>(t.raw());
  for (std::size_t i = 0; i < t.nbytes(); ++i)
    p[i] = static_cast<unsigned char>(dt == kg::DType::Bool ? rng() % 2 : rng() % 256);
  return t;
}

const kg::DType kAll[] = {kg::DType::Bool, kg::DType::I8,  kg::DType::I16,  kg::DType::I32, kg::DType::I64,
                          kg::DType::U8,   kg::DType::F16, kg::DType::BF16, kg::DType::F32, kg::DType::F64};

}  // namespace

TEST(Safetensors, RoundTripEveryDtype) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TempDir tmp;
  const std::vector<std::vector<std::int64_t>> shapes{{3, 5}, {7}, {}, {2, 0, 3}, {1, 1, 1, 3}};
  std::map<std::string, kg::Tensor> tensors;
  for (kg::DType dt : kAll)
    for (std::size_t s = 0; s < shapes.size(); ++s)
      tensors[std::string("features.") + std::string(kg::dtype_name(dt)) + "." + std::to_string(s)] =
          random_bytes(rng, dt, shapes[s]);
  const std::map<std::string, std::string> meta{{"format", "pt"}, {"note", "dotted \"names\" \u00e9"}};
  const std::string path = tmp.path("all.safetensors");
  kg::write_safetensors(path, tensors, meta);

  std::map<std::string, std::string> got_meta;
  auto back = kg::read_safetensors(path, &got_meta);
  EXPECT_EQ(got_meta, meta);
  ASSERT_EQ(back.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(back.count(name));
    const kg::Tensor& b = back.at(name);
    EXPECT_EQ(b.dtype(), t.dtype());
    EXPECT_EQ(b.shape(), t.shape());
    ASSERT_EQ(b.nbytes(), t.nbytes());
    if (t.nbytes()) {
      EXPECT_EQ(std::memcmp(b.raw(), t.raw(), t.nbytes()), 0);
    }
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.raw()) % kg::dtype_size(b.dtype()), 0u);
  }
  // Without asking for the metadata.
  EXPECT_EQ(kg::read_safetensors(path).size(), tensors.size());
  // No temporary file is left beside it; writing again replaces it.
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.dir), fs::directory_iterator()), 1);
  kg::write_safetensors(path, {{"only", kg::Tensor::from_vector<float>({2}, {1.5f, -2.f})}});
  auto only = kg::read_safetensors(path, &got_meta);
  ASSERT_EQ(only.size(), 1u);
  EXPECT_EQ(only.at("only").item(1), -2.0);
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.dir), fs::directory_iterator()), 1);
}

TEST(Safetensors, WrittenLayout) {
  TempDir tmp;
  const std::string path = tmp.path("layout.safetensors");
  std::map<std::string, kg::Tensor> t{{"b", kg::Tensor::from_vector<std::int64_t>({3}, {1, -2, 3})},
                                      {"a.weight", kg::Tensor::from_vector<float>({2, 2}, {1, 2, 3, 4})},
                                      {"c", kg::Tensor::zeros(kg::DType::F16, {0})}};
  kg::write_safetensors(path, t, {{"format", "pt"}});
  const std::string bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 8u);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  EXPECT_EQ((8 + n) % 8, 0u) << "tensor data must start 8-byte aligned";
  ASSERT_EQ(bytes.size(), 8 + n + 16 + 24);
  auto header = nlohmann::ordered_json::parse(bytes.substr(8, n));
  std::vector<std::string> keys;
  for (auto it = header.begin(); it != header.end(); ++it) keys.push_back(it.key());
  EXPECT_EQ(keys, (std::vector<std::string>{"__metadata__", "a.weight", "b", "c"}));
  EXPECT_EQ(header["__metadata__"]["format"], "pt");
  EXPECT_EQ(header["a.weight"]["dtype"], "F32");
  EXPECT_EQ(header["a.weight"]["shape"], nlohmann::json::array({2, 2}));
  EXPECT_EQ(header["a.weight"]["data_offsets"], nlohmann::json::array({0, 16}));
  EXPECT_EQ(header["b"]["dtype"], "I64");
  EXPECT_EQ(header["b"]["data_offsets"], nlohmann::json::array({16, 40}));
  EXPECT_EQ(header["c"]["dtype"], "F16");
  EXPECT_EQ(header["c"]["shape"], nlohmann::json::array({0}));
  EXPECT_EQ(header["c"]["data_offsets"], nlohmann::json::array({40, 40}));
  EXPECT_EQ(bytes.substr(8 + n), raw_values<float>({1, 2, 3, 4}) + raw_values<std::int64_t>({1, -2, 3}));
  // No metadata: no __metadata__ entry.
  kg::write_safetensors(path, {{"x", kg::Tensor::zeros(kg::DType::U8, {1})}});
  EXPECT_EQ(read_bytes(path).find("__metadata__"), std::string::npos);
}

TEST(Safetensors, ReadsFilesWrittenLikePython) {
  TempDir tmp;
  // What scripts/gen-fixtures' save() writes: json.dumps(separators=(",", ":")) with ASCII
  // escapes, keys sorted, metadata first, the header padded with spaces to 8 bytes.
  const std::string header =
      R"({"__metadata__":{"format":"pt","kernel":"caf\u00e9"},"a.weight":{"dtype":"F32","shape":[2,2],)"
      R"("data_offsets":[0,16]},"b":{"dtype":"I64","shape":[3],"data_offsets":[16,40]},)"
      R"("caf\u00e9":{"dtype":"BF16","shape":[2],"data_offsets":[40,44]},)"
      R"("empty":{"dtype":"F32","shape":[0,4],"data_offsets":[44,44]},)"
      R"("flags":{"dtype":"BOOL","shape":[3],"data_offsets":[44,47]}})";
  // bf16 1.0 = 0x3F80, -2.5 = 0xC020.
  const std::string data = raw_values<float>({0.5f, -1.f, 2.f, 3.25f}) +
                           raw_values<std::int64_t>({7, -8, 1LL << 40}) +
                           raw_values<std::uint16_t>({0x3F80, 0xC020}) + std::string("\x01\x00\x01", 3);
  for (bool pad : {true, false}) {  // unpadded: the data is not aligned and gets copied
    SCOPED_TRACE(pad ? "padded" : "unpadded");
    const std::string path = tmp.path(pad ? "py.safetensors" : "py_unaligned.safetensors");
    std::string hdr = header;
    if (!pad)
      while (hdr.size() % 8 != 1) hdr.push_back(' ');  // every tensor misaligned
    write_bytes(path, file_bytes(hdr, data, pad));
    std::map<std::string, std::string> meta;
    auto t = kg::read_safetensors(path, &meta);
    EXPECT_EQ(meta.at("format"), "pt");
    EXPECT_EQ(meta.at("kernel"), "caf\u00e9");
    ASSERT_EQ(t.size(), 5u);
    const kg::Tensor& w = t.at("a.weight");
    EXPECT_EQ(w.dtype(), kg::DType::F32);
    EXPECT_EQ(w.shape(), (std::vector<std::int64_t>{2, 2}));
    EXPECT_EQ(w.data<float>()[3], 3.25f);
    EXPECT_EQ(w.data<float>()[1], -1.f);
    const kg::Tensor& b = t.at("b");
    EXPECT_EQ(b.data<std::int64_t>()[2], 1LL << 40);
    EXPECT_EQ(b.data<std::int64_t>()[1], -8);
    const kg::Tensor& h = t.at("caf\u00e9");
    EXPECT_EQ(h.dtype(), kg::DType::BF16);
    EXPECT_EQ(h.item(0), 1.0);
    EXPECT_EQ(h.item(1), -2.5);
    EXPECT_EQ(t.at("empty").numel(), 0);
    EXPECT_EQ(t.at("empty").shape(), (std::vector<std::int64_t>{0, 4}));
    EXPECT_EQ(t.at("flags").dtype(), kg::DType::Bool);
    EXPECT_EQ(t.at("flags").item(0), 1.0);
    EXPECT_EQ(t.at("flags").item(1), 0.0);
    for (const auto& [name, x] : t)
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(x.raw()) % kg::dtype_size(x.dtype()), 0u) << name;
  }
  // Data in another order than the names, and a header with whitespace.
  const std::string path = tmp.path("order.safetensors");
  write_bytes(path, file_bytes(R"({ "z": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]},
      "a": {"data_offsets": [4, 12], "shape": [2], "dtype": "F32"} })",
                               raw_values<std::int32_t>({-5}) + raw_values<float>({1.f, 2.f})));
  auto t = kg::read_safetensors(path);
  EXPECT_EQ(t.at("z").item(0), -5.0);
  EXPECT_EQ(t.at("a").item(1), 2.0);
}

TEST(Safetensors, FixtureFilesRead) {
  // Every fixture that scripts/gen-fixtures wrote reads, with sizes matching the file.
  const fs::path dir = fs::path(KG_SOURCE_DIR) / "tests" / "fixtures";
  int files = 0;
  if (fs::exists(dir))
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.path().extension() != ".safetensors") continue;
      SCOPED_TRACE(entry.path().string());
      ++files;
      std::size_t bytes = 0;
      auto t = kg::read_safetensors(entry.path().string());
      for (const auto& [name, x] : t) bytes += x.nbytes();
      EXPECT_LE(bytes, fs::file_size(entry.path()));
    }
  if (files == 0) GTEST_SKIP() << "no fixtures generated yet";
}

TEST(Safetensors, TensorsKeepTheMappingAlive) {
  TempDir tmp;
  const std::string path = tmp.path("alive.safetensors");
  kg::write_safetensors(path, {{"x", kg::Tensor::from_vector<double>({3}, {1.25, -7, 9})}});
  kg::Tensor x;
  {
    auto all = kg::read_safetensors(path);
    x = all.at("x");
  }
  fs::remove(path);
  EXPECT_EQ(x.item(0), 1.25);
  EXPECT_EQ(x.item(2), 9.0);
  kg::Tensor copy = x.clone();
  EXPECT_EQ(copy.item(1), -7.0);
}

TEST(Safetensors, MalformedFilesAreErrors) {
  TempDir tmp;
  int k = 0;
  // Writes `bytes` to a new file and expects a kg::Error naming the file and `problem`.
  auto check = [&](const std::string& bytes, const std::vector<std::string>& problem) {
    const std::string path = tmp.path("bad" + std::to_string(k++) + ".safetensors");
    write_bytes(path, bytes);
    std::vector<std::string> parts{"safetensors file '" + path + "'"};
    parts.insert(parts.end(), problem.begin(), problem.end());
    SCOPED_TRACE(path);
    expect_error([&] { kg::read_safetensors(path); }, parts);
  };
  const std::string f32x2 = raw_values<float>({1.f, 2.f});
  auto one = [](const std::string& entry) { return std::string(R"({"t":)") + entry + "}"; };

  check("", {"truncated: 0 bytes"});
  check(std::string("\x05\x00\x00", 3), {"truncated: 3 bytes"});
  check(std::string(7, '\0'), {"truncated: 7 bytes"});
  check(le64(1000) + "{}" + std::string(10, ' '), {"header length 1000 does not fit in a file of 20 bytes"});
  check(le64(~0ULL) + "{}", {"header length 18446744073709551615 does not fit"});
  check(le64(0), {"header is not valid JSON"});
  check(file_bytes(R"({"t": {"dtype": "F32",)", f32x2), {"header is not valid JSON"});
  check(file_bytes("[1, 2, 3]", ""), {"header is not a JSON object"});
  check(file_bytes("\"str\"", ""), {"header is not a JSON object"});
  check(file_bytes(one(R"({"dtype":"F32","shape":[2]})"), f32x2),
        {"tensor 't' needs dtype, shape and data_offsets"});
  check(file_bytes(one(R"({"shape":[2],"data_offsets":[0,8]})"), f32x2), {"tensor 't' needs dtype"});
  check(file_bytes(one(R"({"dtype":"F32","data_offsets":[0,8]})"), f32x2), {"tensor 't' needs"});
  check(file_bytes(one("[1]"), f32x2), {"tensor 't' needs"});
  check(file_bytes(one(R"({"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]})"), f32x2),
        {"tensor 't': unsupported dtype 'F8_E4M3'"});
  check(file_bytes(one(R"({"dtype":"f32","shape":[2],"data_offsets":[0,8]})"), f32x2),
        {"tensor 't': unsupported dtype 'f32'"});
  check(file_bytes(one(R"({"dtype":4,"shape":[2],"data_offsets":[0,8]})"), f32x2),
        {"tensor 't': dtype is not a string"});
  check(file_bytes(one(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"), f32x2),
        {"tensor 't': shape has a non-integer or negative entry"});
  check(file_bytes(one(R"({"dtype":"F32","shape":[2.5],"data_offsets":[0,8]})"), f32x2),
        {"tensor 't': shape has a non-integer or negative entry"});
  check(file_bytes(one(R"({"dtype":"F32","shape":["2"],"data_offsets":[0,8]})"), f32x2),
        {"tensor 't': shape has a non-integer"});
  check(file_bytes(one(R"({"dtype":"F32","shape":2,"data_offsets":[0,8]})"), f32x2),
        {"tensor 't': shape is not an array"});
  // Shapes whose element count overflows must not wrap around to a small byte count.
  check(file_bytes(one(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]})"), f32x2),
        {"tensor 't': shape [4294967296,4294967296] has too many elements"});
  check(file_bytes(one(R"({"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,0]})"), f32x2),
        {"tensor 't'", "too many elements"});
  check(file_bytes(one(R"({"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]})"), f32x2),
        {"tensor 't'", "too many elements"});
  check(file_bytes(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,100]})"), f32x2),
        {"tensor 't': data_offsets [0, 100] exceed the 8 data bytes"});
  check(file_bytes(one(R"({"dtype":"F32","shape":[1],"data_offsets":[8,4]})"), f32x2),
        {"data_offsets [8, 4]"});
  check(file_bytes(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0]})"), f32x2),
        {"tensor 't': data_offsets must be two non-negative integers"});
  check(file_bytes(one(R"({"dtype":"F32","shape":[2],"data_offsets":[-8,0]})"), f32x2),
        {"data_offsets must be two non-negative integers"});
  check(file_bytes(one(R"({"dtype":"F32","shape":[2],"data_offsets":"0-8"})"), f32x2),
        {"data_offsets must be two"});
  check(file_bytes(one(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"), f32x2),
        {"tensor 't': 8 bytes for [3] f32, which needs 12"});
  check(file_bytes(one(R"({"dtype":"F64","shape":[2],"data_offsets":[0,8]})"), f32x2),
        {"8 bytes for [2] f64, which needs 16"});
  const std::string f32x3 = raw_values<float>({1.f, 2.f, 3.f});
  check(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                   R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                   f32x3),
        {"tensor data ranges overlap: 'a' [0, 8] and 'b' [4, 12]"});
  // An empty tensor between them must not hide the overlap.
  check(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                   R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                   R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                   f32x3),
        {"overlap: 'a' [0, 8] and 'b' [4, 12]"});
  // Same range twice.
  check(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                   R"("b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})",
                   f32x2),
        {"overlap"});
  // A range inside another.
  check(file_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)"
                   R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                   f32x3),
        {"overlap: 'a' [0, 12] and 'b' [4, 8]"});
  check(file_bytes(R"({"__metadata__":[1]})", ""), {"__metadata__ is not an object"});

  // A metadata value that is not a string, when the metadata is asked for.
  const std::string path = tmp.path("meta.safetensors");
  write_bytes(path, file_bytes(R"({"__metadata__":{"epoch":3}})", ""));
  std::map<std::string, std::string> meta;
  expect_error([&] { kg::read_safetensors(path, &meta); },
               {path, "__metadata__ value 'epoch' is not a string"});

  // Not a file at all.
  const std::string missing = tmp.path("missing.safetensors");
  expect_error([&] { kg::read_safetensors(missing); }, {missing, "does not exist"});
  expect_error([&] { kg::read_safetensors(tmp.dir.string()); }, {tmp.dir.string(), "is a folder"});

  // Adjacent, empty and gapped ranges are fine.
  const std::string okp = tmp.path("ok.safetensors");
  write_bytes(okp, file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                              R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                              f32x3));
  auto ok = kg::read_safetensors(okp);
  EXPECT_EQ(ok.at("a").item(0), 1.0);
  EXPECT_EQ(ok.at("b").item(0), 3.0);
}

TEST(Safetensors, EveryTruncationIsAnError) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TempDir tmp;
  const std::string path = tmp.path("full.safetensors");
  kg::write_safetensors(
      path, {{"w", random_bytes(rng, kg::DType::F32, {3, 4})}, {"z", random_bytes(rng, kg::DType::I64, {5})}},
      {{"k", "v"}});
  const std::string full = read_bytes(path);
  const std::string cut = tmp.path("cut.safetensors");
  write_bytes(cut, full);
  for (std::size_t len = full.size(); len-- > 0;) {
    fs::resize_file(cut, len);
    try {
      kg::read_safetensors(cut);
      ADD_FAILURE() << "a file cut to " << len << " of " << full.size() << " bytes was read";
    } catch (const kg::Error& e) {
      EXPECT_NE(std::string(e.what()).find(cut), std::string::npos) << e.what();
    }
  }
}

TEST(Safetensors, CorruptHeadersNeverCrash) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TempDir tmp;
  const std::string path = tmp.path("good.safetensors");
  kg::write_safetensors(path,
                        {{"a", random_bytes(rng, kg::DType::F32, {2, 3})},
                         {"b", random_bytes(rng, kg::DType::I16, {4})},
                         {"c", random_bytes(rng, kg::DType::BF16, {0})}},
                        {{"format", "pt"}});
  const std::string good = read_bytes(path);
  const std::string bad = tmp.path("mutated.safetensors");
  write_bytes(bad, good);
  const char interesting[] = "0123456789-.,:[]{}\"eE \x00\xff";
  int read_ok = 0, errors = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    std::string b = good;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      // Mostly inside the length and the JSON header.
      const std::size_t limit = std::min<std::size_t>(b.size(), 8 + 200);
      const std::size_t at = rng() % limit;
      b[at] = rng() % 2 ? interesting[rng() % (sizeof(interesting) - 1)] : static_cast<char>(rng() % 256);
    }
    overwrite_bytes(bad, b);
    try {
      std::map<std::string, std::string> meta;
      auto t = kg::read_safetensors(bad, &meta);
      ++read_ok;
      // Whatever was accepted lies inside the file: touch every byte.
      std::size_t sum = 0;
      for (const auto& [name, x] : t) {
        ASSERT_LE(x.nbytes(), b.size()) << name;
        const auto* p = static_cast<const unsigned char*>(x.raw());
        for (std::size_t i = 0; i < x.nbytes(); ++i) sum += p[i];
      }
      (void)sum;
    } catch (const kg::Error& e) {
      ++errors;
      ASSERT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      FAIL() << "trial " << trial << ": not a kg::Error: " << e.what();
    }
  }
  EXPECT_GT(errors, 0);
  RecordProperty("read_ok", read_ok);
}

TEST(Safetensors, WriteErrors) {
  TempDir tmp;
  const std::string nodir = tmp.path("no/such/dir/w.safetensors");
  expect_error(
      [&] {
        kg::write_safetensors(nodir, {{"x", kg::Tensor::zeros(kg::DType::F32, {2})}});
      },
      {"cannot write", "no/such/dir/w.safetensors"});
  expect_error(
      [&] {
        kg::write_safetensors(tmp.path("m.safetensors"),
                              {{"__metadata__", kg::Tensor::zeros(kg::DType::F32, {1})}});
      },
      {"'__metadata__' is not a tensor name"});
  expect_error(
      [&] {
        kg::write_safetensors(tmp.path("u.safetensors"), {{"ghost", kg::Tensor()}});
      },
      {"u.safetensors", "tensor 'ghost' has no data"});
  // Nothing was left behind by the failed writes.
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.dir), fs::directory_iterator()), 0);
  // An empty map writes a valid, empty file.
  const std::string empty = tmp.path("empty.safetensors");
  kg::write_safetensors(empty, {});
  EXPECT_TRUE(kg::read_safetensors(empty).empty());
  EXPECT_EQ(read_bytes(empty).size() % 8, 0u);
}
