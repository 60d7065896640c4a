// safetensors: 8-byte little-endian header length, a JSON header, then the tensor bytes.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "kg/error.hpp"
#include "kg/io.hpp"
#include "util/str.hpp"

namespace kg {
namespace {

constexpr std::uint64_t kMaxHeader = 100u << 20;  // 100 MiB of JSON is not a real header
constexpr auto kMaxSize = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());

[[noreturn]] void bad(const std::string& path, const std::string& why) {
  throw Error("safetensors file '" + path + "': " + why);
}

}  // namespace

std::map<std::string, Tensor> read_safetensors(const std::string& path) {
  return read_safetensors(path, nullptr);
}

std::map<std::string, Tensor> read_safetensors(const std::string& path,
                                               std::map<std::string, std::string>* metadata) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) bad(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    bad(path, "cannot stat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    bad(path, "not a regular file");
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    bad(path, util::cat("truncated: ", size, " bytes, the 8-byte header length is missing"));
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) bad(path, "mmap failed");
  std::shared_ptr<void> owner(map, [size](void* p) { ::munmap(p, size); });
  const auto* bytes = static_cast<const unsigned char*>(map);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > kMaxHeader || n > size - 8)
    bad(path, util::cat("header length ", n, " does not fit in a file of ", size, " bytes (truncated or not safetensors)"));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + n);
  } catch (const std::exception& e) {
    bad(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) bad(path, "header is not a JSON object");
  const std::uint64_t data_start = 8 + n, data_size = size - data_start;
  std::map<std::string, Tensor> out;
  struct Range {
    std::uint64_t begin, end;
    std::string name;
    bool operator<(const Range& o) const { return begin != o.begin ? begin < o.begin : end < o.end; }
  };
  std::vector<Range> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& e = it.value();
    if (name == "__metadata__") {
      if (!e.is_object()) bad(path, "__metadata__ is not an object");
      if (metadata)
        for (auto m = e.begin(); m != e.end(); ++m) {
          if (!m.value().is_string()) bad(path, "__metadata__ value '" + m.key() + "' is not a string");
          (*metadata)[m.key()] = m.value().get<std::string>();
        }
      continue;
    }
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      bad(path, "tensor '" + name + "' needs dtype, shape and data_offsets");
    if (!e["dtype"].is_string()) bad(path, "tensor '" + name + "': dtype is not a string");
    auto dt = parse_dtype(e["dtype"].get<std::string>());
    if (!dt || e["dtype"].get<std::string>() != dtype_safetensors_code(*dt))
      bad(path, "tensor '" + name + "': unsupported dtype '" + e["dtype"].get<std::string>() + "'");
    std::vector<std::int64_t> shape;
    if (!e["shape"].is_array()) bad(path, "tensor '" + name + "': shape is not an array");
    std::uint64_t numel = 1;  // checked: a forged shape must not overflow into a small size
    for (const auto& d : e["shape"]) {
      if (!d.is_number_unsigned()) bad(path, "tensor '" + name + "': shape has a non-integer or negative entry");
      const auto v = d.get<std::uint64_t>();
      if (v > kMaxSize || __builtin_mul_overflow(numel, v, &numel) || numel > kMaxSize)
        bad(path, "tensor '" + name + "': shape " + e["shape"].dump() + " has too many elements");
      shape.push_back(static_cast<std::int64_t>(v));
    }
    const auto& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad(path, "tensor '" + name + "': data_offsets must be two non-negative integers");
    auto b = off[0].get<std::uint64_t>(), end = off[1].get<std::uint64_t>();
    if (b > end || end > data_size)
      bad(path, util::cat("tensor '", name, "': data_offsets [", b, ", ", end, "] exceed the ", data_size,
                          " data bytes (truncated file?)"));
    std::uint64_t want = 0;
    if (__builtin_mul_overflow(numel, std::uint64_t{dtype_size(*dt)}, &want))
      bad(path, "tensor '" + name + "': shape " + e["shape"].dump() + " has too many elements");
    if (end - b != want)
      bad(path, util::cat("tensor '", name, "': ", end - b, " bytes for ", sizes_to_string(shape), " ",
                          dtype_name(*dt), ", which needs ", want));
    ranges.push_back({b, end, name});
    void* p = const_cast<unsigned char*>(bytes + data_start + b);
    Tensor t = Tensor::wrap(owner, p, *dt, shape);
    if (reinterpret_cast<std::uintptr_t>(p) % dtype_size(*dt) != 0) t = t.clone();  // unaligned
    out.emplace(name, t);
  }
  // Empty ranges overlap nothing; each non-empty one must start at or after the end of all before.
  std::sort(ranges.begin(), ranges.end());
  const Range* last = nullptr;
  for (const auto& r : ranges) {
    if (r.begin == r.end) continue;
    if (last && r.begin < last->end)
      bad(path, util::cat("tensor data ranges overlap: '", last->name, "' [", last->begin, ", ", last->end,
                          "] and '", r.name, "' [", r.begin, ", ", r.end, "]"));
    last = &r;
  }
  return out;
}

void write_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") throw Error("write_safetensors: '__metadata__' is not a tensor name");
    if (!t.defined())
      throw Error("write_safetensors '" + path + "': tensor '" + name +
                  "' has no data (default-constructed)");
    header[name] = {{"dtype", dtype_safetensors_code(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');  // keep the data 8-byte aligned
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error("cannot write '" + tmp + "'");
    std::uint64_t n = h.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
    f.write(reinterpret_cast<const char*>(len), 8);
    f.write(h.data(), static_cast<std::streamsize>(h.size()));
    for (const auto& [name, t] : tensors)
      f.write(static_cast<const char*>(t.raw()), static_cast<std::streamsize>(t.nbytes()));
    if (!f.good()) {
      std::remove(tmp.c_str());
      throw Error("error writing '" + tmp + "'");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error("cannot rename '" + tmp + "' to '" + path + "'");
  }
}

}  // namespace kg
