#include "io/onnx_tensor.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <limits>

#include "kg/error.hpp"
#include "util/half.hpp"
#include "util/memory.hpp"
#include "util/str.hpp"

namespace kg::onnx::detail {

std::string read_file(const std::string& path, std::uint64_t max_bytes, const std::string& what) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; the type is checked before reading.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw Error(util::cat(what, " '", path, "': cannot open: ", std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(util::cat(what, " '", path, "': not a regular file"));
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > max_bytes) {
    ::close(fd);
    throw Error(util::cat(what, " '", path, "': ", size, " bytes, more than the ", max_bytes, " this reader takes"));
  }
  std::string bytes(static_cast<std::size_t>(size), '\0');
  std::size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t r = ::read(fd, bytes.data() + got, bytes.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      ::close(fd);
      throw Error(util::cat(what, " '", path, "': read failed after ", got, " of ", size, " bytes"));
    }
    got += static_cast<std::size_t>(r);
  }
  ::close(fd);
  return bytes;
}

// ---- external data ----

ExternalFiles::ExternalFiles(std::string base_dir) : base_dir_(base_dir.empty() ? "." : std::move(base_dir)) {}

ExternalFiles::~ExternalFiles() {
  for (auto& [name, f] : files_)
    if (f.fd >= 0) ::close(f.fd);
}

const ExternalFiles::File& ExternalFiles::open(const std::string& location, const std::string& context) {
  if (auto it = files_.find(location); it != files_.end()) return it->second;
  namespace fs = std::filesystem;
  const std::string shown = util::printable(location);
  auto refuse = [&](const std::string& why) -> Error {
    return Error(util::cat(context, ": external data location '", shown, "' ", why));
  };
  // A relative path with no ".." component (a file named "a..b.bin" is fine).
  const fs::path rel(location);
  if (rel.is_absolute() || location.find('\0') != std::string::npos)
    throw refuse("must be a relative path inside the model's folder");
  for (const auto& part : rel)
    if (part == "..") throw refuse("must be a relative path inside the model's folder (it has a '..' component)");
  // Symbolic links are resolved, and the file must still be inside the model's folder.
  std::error_code ec;
  const fs::path base = fs::canonical(base_dir_, ec);
  if (ec) throw refuse(util::cat("cannot be read: the model's folder '", util::printable(base_dir_), "': ", ec.message()));
  const fs::path real = fs::canonical(base / rel, ec);
  if (ec) throw refuse(util::cat("cannot be opened: ", ec.message()));
  const auto [b_end, r_at] = std::mismatch(base.begin(), base.end(), real.begin(), real.end());
  if (b_end != base.end() || r_at == real.end())
    throw refuse(util::cat("resolves to '", util::printable(real.string()),
                           "', outside the model's folder (symbolic links out of it are refused)"));
  // O_NONBLOCK: a FIFO never blocks the open; O_NOFOLLOW: the resolved path is not swapped for a
  // link; the type is checked before a byte is read.
  const int fd = ::open(real.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
  if (fd < 0) throw refuse(util::cat("cannot be opened: ", std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw refuse(S_ISDIR(st.st_mode)    ? "is a folder, not a file"
                 : S_ISFIFO(st.st_mode) ? "is a FIFO, not a regular file"
                 : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "is a device, not a regular file"
                                                              : "is not a regular file");
  }
  File f;
  f.fd = fd;
  f.size = static_cast<std::uint64_t>(st.st_size);
  f.path = real.string();
  return files_.emplace(location, std::move(f)).first->second;
}

void ExternalFiles::read(const std::string& location, std::uint64_t offset, std::uint64_t length, void* out,
                         const std::string& context) {
  const File& f = open(location, context);
  if (offset > f.size || f.size - offset < length)
    throw Error(util::cat(context, ": external data file '", util::printable(f.path), "' has ", f.size, " bytes; ",
                          length, " are needed at offset ", offset));
  auto* p = static_cast<char*>(out);
  std::uint64_t got = 0;
  while (got < length) {
    const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(length - got, std::uint64_t{1} << 30));
    const ssize_t r = ::pread(f.fd, p + got, want, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      throw Error(util::cat(context, ": external data file '", util::printable(f.path), "': read failed after ", got,
                            " of ", length, " bytes at offset ", offset, r < 0 ? util::cat(": ", std::strerror(errno)) : ""));
    got += static_cast<std::uint64_t>(r);
  }
}

void check_memory(const std::string& who, std::uint64_t bytes, const std::string& what) {
  if (util::memory_check_disabled()) return;
  const auto avail = util::available_memory();
  if (!avail || bytes <= avail->bytes) return;
  throw Error(util::cat(who, ": ", what, " needs ", bytes, " bytes (", util::format_bytes(bytes), ") but ",
                        avail->bytes, " bytes (", util::format_bytes(avail->bytes), ") are available (", avail->source,
                        "); set KG_NO_MEMORY_CHECK=1 to allocate anyway"));
}

std::optional<DType> dtype_of(int t) {
  using T = ::onnx::TensorProto;
  switch (t) {
    case T::FLOAT: return DType::F32;
    case T::DOUBLE: return DType::F64;
    case T::FLOAT16: return DType::F16;
    case T::BFLOAT16: return DType::BF16;
    case T::INT8: return DType::I8;
    case T::INT16: return DType::I16;
    case T::INT32: return DType::I32;
    case T::INT64: return DType::I64;
    case T::UINT8: return DType::U8;
    case T::BOOL: return DType::Bool;
    default: return std::nullopt;
  }
}

std::string onnx_type_name(int t) {
  if (::onnx::TensorProto_DataType_IsValid(t))
    return ::onnx::TensorProto_DataType_Name(static_cast<::onnx::TensorProto_DataType>(t));
  // Types of later ONNX versions than the schema compiled in (float 8 from 1.14, 4-bit from 1.16).
  static const char* const later[] = {"FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ",
                                      "UINT4",        "INT4",           "FLOAT4E2M1"};
  if (t >= 17 && t <= 23) return later[t - 17];
  return util::cat("type ", t);
}

namespace {

// Copies `n` values of a repeated field into the tensor, converting to its element type.
template <class Dst, class Field>
void copy_field(const Field& f, Tensor& out) {
  auto* d = static_cast<Dst*>(out.raw());
  for (int i = 0; i < f.size(); ++i) d[i] = static_cast<Dst>(f.Get(i));
}

}  // namespace

Tensor to_tensor(const ::onnx::TensorProto& t, const std::string& context, ExternalFiles& external) {
  using T = ::onnx::TensorProto;
  const auto dtype = dtype_of(t.data_type());
  if (!dtype) throw Error(util::cat(context, ": element type ", onnx_type_name(t.data_type()), " is not supported"));
  std::vector<std::int64_t> shape;
  std::int64_t numel = 1;
  constexpr std::int64_t kMaxElements = std::int64_t{1} << 40;
  for (int i = 0; i < t.dims_size(); ++i) {
    const std::int64_t d = t.dims(i);
    if (d < 0) throw Error(util::cat(context, ": negative dim ", d, " in its shape"));
    if (d != 0 && numel > kMaxElements / d)
      throw Error(util::cat(context, ": its shape has more than 2^40 elements"));
    numel *= d;
    shape.push_back(d);
  }
  const std::size_t esize = dtype_size(*dtype);
  const auto nbytes = static_cast<std::uint64_t>(numel) * esize;
  auto shape_text = [&] { return util::cat(sizes_to_string(shape), " ", dtype_name(*dtype)); };

  if (t.data_location() == T::EXTERNAL) {
    std::string location;
    std::uint64_t offset = 0, length = nbytes;
    bool has_length = false;
    for (const auto& kv : t.external_data()) {
      auto number = [&] {
        const std::string& v = kv.value();
        std::uint64_t x = 0;
        const bool digits = !v.empty() && v.size() <= 20 &&
                            std::all_of(v.begin(), v.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
        if (!digits || std::from_chars(v.data(), v.data() + v.size(), x).ec != std::errc())
          throw Error(util::cat(context, ": external data ", util::printable(kv.key()), " '", util::printable(v),
                                "' is not a number of bytes"));
        return x;
      };
      if (kv.key() == "location") location = kv.value();
      if (kv.key() == "offset") offset = number();
      if (kv.key() == "length") length = number(), has_length = true;
    }
    if (location.empty()) throw Error(context + ": external data without a location");
    if (has_length && length != nbytes)
      throw Error(util::cat(context, ": external data length ", length, " but ", shape_text(), " needs ", nbytes));
    check_memory(context, nbytes, util::cat("its external data (", shape_text(), ")"));
    Tensor out = Tensor::empty(*dtype, shape);
    external.read(location, offset, nbytes, out.raw(), context);
    return out;
  }

  if (t.has_raw_data()) {
    if (t.raw_data().size() != nbytes)
      throw Error(util::cat(context, ": raw data of ", t.raw_data().size(), " bytes, but ", shape_text(), " needs ",
                            nbytes));
    Tensor out = Tensor::empty(*dtype, shape);
    if (nbytes) std::memcpy(out.raw(), t.raw_data().data(), nbytes);
    return out;
  }

  // Typed fields: float_data (float), int32_data (int32, int16, int8, uint8, bool, float16 and
  // bfloat16 as bits), int64_data, double_data.
  std::int64_t have = 0;
  switch (t.data_type()) {
    case T::FLOAT: have = t.float_data_size(); break;
    case T::DOUBLE: have = t.double_data_size(); break;
    case T::INT64: have = t.int64_data_size(); break;
    default: have = t.int32_data_size(); break;
  }
  if (have != numel)
    throw Error(util::cat(context, ": holds ", have, " values, but ", shape_text(), " has ", numel, " elements"));
  check_memory(context, nbytes, shape_text());
  Tensor out = Tensor::empty(*dtype, shape);
  switch (t.data_type()) {
    case T::FLOAT: copy_field<float>(t.float_data(), out); break;
    case T::DOUBLE: copy_field<double>(t.double_data(), out); break;
    case T::INT64: copy_field<std::int64_t>(t.int64_data(), out); break;
    case T::INT32: copy_field<std::int32_t>(t.int32_data(), out); break;
    case T::INT16: copy_field<std::int16_t>(t.int32_data(), out); break;
    case T::INT8: copy_field<std::int8_t>(t.int32_data(), out); break;
    case T::UINT8: copy_field<std::uint8_t>(t.int32_data(), out); break;
    case T::BOOL: {
      auto* d = static_cast<std::uint8_t*>(out.raw());
      for (int i = 0; i < t.int32_data_size(); ++i) d[i] = t.int32_data(i) != 0;
      break;
    }
    case T::FLOAT16:
    case T::BFLOAT16: copy_field<std::uint16_t>(t.int32_data(), out); break;
    default: throw Error(util::cat(context, ": element type ", onnx_type_name(t.data_type()), " is not supported"));
  }
  return out;
}

}  // namespace kg::onnx::detail
