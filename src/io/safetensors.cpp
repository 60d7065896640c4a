// safetensors: 8-byte little-endian header length, a JSON header, then the tensor bytes.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "kg/error.hpp"
#include "kg/io.hpp"
#include "util/file.hpp"
#include "util/memory.hpp"
#include "util/str.hpp"

namespace kg {
namespace {

constexpr std::uint64_t kMaxHeader = 100u << 20;  // 100 MiB of JSON is not a real header
constexpr auto kMaxSize = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());

// The deepest nesting a header may have. The format needs 3 (header object, tensor object, shape
// array); anything deeper is rejected while parsing, so that no recursive walk of the parsed JSON
// (dump, comparison, destruction) can run out of stack on a forged header.
constexpr int kMaxDepth = 16;
// Longest piece of the file's own text (a name, a dtype, a dumped value) quoted in a message.
constexpr std::size_t kMaxQuote = 80;

[[noreturn]] void bad(const std::string& path, const std::string& why) {
  throw Error("safetensors file '" + path + "': " + why);
}

// Text from the file, clipped to kMaxQuote characters for a message.
std::string clip(const std::string& s, std::size_t max = kMaxQuote) {
  if (s.size() <= max) return s;
  return s.substr(0, max) + util::cat("... (", s.size(), " characters)");
}

// A JSON value from the header for a message: compact, clipped. (Depth is bounded by the parse.)
std::string clip(const nlohmann::json& j) {
  return clip(j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

}  // namespace

std::map<std::string, Tensor> read_safetensors(const std::string& path) {
  return read_safetensors(path, nullptr);
}

std::map<std::string, Tensor> read_safetensors(const std::string& path,
                                               std::map<std::string, std::string>* metadata) {
  // The guarded read: a regular file only (a folder, FIFO or device is named as such and never
  // blocks), read into memory rather than mapped, so that a file cut short while it is in use
  // (another process truncating an --input file) is an error here, never a SIGBUS later.
  util::ReadFile file;
  {
    std::string why;
    if (!util::ReadFile::try_open(path, {kMaxSize, true}, file, &why)) bad(path, why);
  }
  const std::uint64_t size = file.size();
  if (size < 8) bad(path, util::cat("truncated: ", size, " bytes, the 8-byte header length is missing"));
  if (!util::memory_check_disabled())
    if (const auto avail = util::available_memory(); avail && size > avail->bytes)
      bad(path, util::cat("is ", size, " bytes (", util::format_bytes(size), "), more than the ", avail->bytes,
                          " bytes (", util::format_bytes(avail->bytes), ") available (", avail->source,
                          "); set KG_NO_MEMORY_CHECK=1 to read it anyway"));
  // One block, 64-byte aligned, owned by every tensor that views it.
  const std::size_t alloc = static_cast<std::size_t>((size + 63) / 64 * 64);
  void* block = std::aligned_alloc(64, alloc);
  if (!block) bad(path, util::cat("cannot allocate ", size, " bytes to read it"));
  std::shared_ptr<void> owner(block, [](void* p) { std::free(p); });
  try {
    file.read_at(block, 0, static_cast<std::size_t>(size));
  } catch (const Error& e) {
    bad(path, e.what());
  }
  const auto* bytes = static_cast<const unsigned char*>(block);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > kMaxHeader || n > size - 8)
    bad(path, util::cat("header length ", n, " does not fit in a file of ", size, " bytes (truncated or not safetensors)"));
  // The nesting bound is checked by a scan of the text before parsing, not by a parser callback:
  // nlohmann's callback parser looks through the whole enclosing object for a discarded value after
  // each nested one ends, which made a header of n tensors take O(n^2) (200k tensors: minutes).
  {
    int depth = 0;
    bool in_string = false, escaped = false;
    for (std::uint64_t i = 8; i < 8 + n; ++i) {
      const unsigned char c = bytes[i];
      if (in_string) {
        if (escaped) escaped = false;
        else if (c == '\\') escaped = true;
        else if (c == '"') in_string = false;
      } else if (c == '"') {
        in_string = true;
      } else if (c == '{' || c == '[') {
        if (++depth > kMaxDepth)
          bad(path, util::cat("header nests arrays or objects more than ", kMaxDepth,
                              " deep (a safetensors header needs 3)"));
      } else if (c == '}' || c == ']') {
        --depth;
      }
    }
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + n);
  } catch (const std::exception& e) {
    bad(path, std::string("header is not valid JSON: ") + clip(std::string(e.what()), 4 * kMaxQuote));
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
    const std::string qname = clip(name);  // the name as messages quote it
    const auto& e = it.value();
    if (name == "__metadata__") {
      if (!e.is_object()) bad(path, "__metadata__ is not an object");
      if (metadata)
        for (auto m = e.begin(); m != e.end(); ++m) {
          if (!m.value().is_string()) bad(path, "__metadata__ value '" + clip(m.key()) + "' is not a string");
          (*metadata)[m.key()] = m.value().get<std::string>();
        }
      continue;
    }
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      bad(path, "tensor '" + qname + "' needs dtype, shape and data_offsets");
    if (!e["dtype"].is_string()) bad(path, "tensor '" + qname + "': dtype is not a string");
    auto dt = parse_dtype(e["dtype"].get<std::string>());
    if (!dt || e["dtype"].get<std::string>() != dtype_safetensors_code(*dt))
      bad(path, "tensor '" + qname + "': unsupported dtype '" + clip(e["dtype"].get<std::string>()) + "'");
    std::vector<std::int64_t> shape;
    if (!e["shape"].is_array()) bad(path, "tensor '" + qname + "': shape is not an array");
    std::uint64_t numel = 1;  // checked: a forged shape must not overflow into a small size
    for (const auto& d : e["shape"]) {
      if (!d.is_number_unsigned()) bad(path, "tensor '" + qname + "': shape has a non-integer or negative entry");
      const auto v = d.get<std::uint64_t>();
      if (v > kMaxSize || __builtin_mul_overflow(numel, v, &numel) || numel > kMaxSize)
        bad(path, "tensor '" + qname + "': shape " + clip(e["shape"]) + " has too many elements");
      shape.push_back(static_cast<std::int64_t>(v));
    }
    const auto& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad(path, "tensor '" + qname + "': data_offsets must be two non-negative integers");
    auto b = off[0].get<std::uint64_t>(), end = off[1].get<std::uint64_t>();
    if (b > end || end > data_size)
      bad(path, util::cat("tensor '", qname, "': data_offsets [", b, ", ", end, "] exceed the ", data_size,
                          " data bytes (truncated file?)"));
    std::uint64_t want = 0;
    if (__builtin_mul_overflow(numel, std::uint64_t{dtype_size(*dt)}, &want))
      bad(path, "tensor '" + qname + "': shape " + clip(e["shape"]) + " has too many elements");
    if (end - b != want)
      bad(path, util::cat("tensor '", qname, "': ", end - b, " bytes for ", sizes_to_string(shape), " ",
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
      bad(path, util::cat("tensor data ranges overlap: '", clip(last->name), "' [", last->begin, ", ",
                          last->end, "] and '", clip(r.name), "' [", r.begin, ", ", r.end, "]"));
    last = &r;
  }
  return out;
}

void write_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // nlohmann::json (a sorted map), not ordered_json, whose every insertion searches the keys so far:
  // a header of n tensors took O(n^2) to build. The order of the header's keys means nothing.
  nlohmann::json header = nlohmann::json::object();
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
  // Written to a new temporary file beside `path` (util::AtomicFile: created exclusively, a link
  // planted at its name never followed), flushed to disk and renamed over `path`: every write, the
  // fsync and the close are checked first, so a full disk (or a file size limit) leaves the previous
  // file as it was instead of renaming a truncated one over it; a `path` that is a device, a FIFO, a
  // folder or a link is refused, never replaced.
  util::AtomicFile f(path, "safetensors file");
  std::uint64_t n = h.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  f.write(len, 8);
  f.write(h);
  for (const auto& [name, t] : tensors) f.write(t.raw(), t.nbytes());
  f.commit();
}

}  // namespace kg
