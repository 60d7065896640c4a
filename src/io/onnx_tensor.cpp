#include "io/onnx_tensor.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "kg/error.hpp"
#include "util/half.hpp"
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

Tensor to_tensor(const ::onnx::TensorProto& t, const std::string& context, const std::string& base_dir) {
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
      try {
        if (kv.key() == "location") location = kv.value();
        if (kv.key() == "offset") offset = std::stoull(kv.value());
        if (kv.key() == "length") length = std::stoull(kv.value()), has_length = true;
      } catch (const std::exception&) {
        throw Error(util::cat(context, ": external data ", kv.key(), " '", kv.value(), "' is not a number"));
      }
    }
    if (location.empty()) throw Error(context + ": external data without a location");
    const std::filesystem::path rel(location);
    if (rel.is_absolute() || location.find("..") != std::string::npos)
      throw Error(util::cat(context, ": external data location '", location,
                            "' must be a relative path inside the model's folder"));
    if (has_length && length != nbytes)
      throw Error(util::cat(context, ": external data length ", length, " but ", shape_text(), " needs ", nbytes));
    const std::string file = (std::filesystem::path(base_dir) / rel).string();
    const std::string bytes = read_file(file, std::numeric_limits<std::uint64_t>::max(), context + " external data");
    if (offset > bytes.size() || bytes.size() - offset < nbytes)
      throw Error(util::cat(context, ": external data file '", file, "' has ", bytes.size(), " bytes; ", nbytes,
                            " are needed at offset ", offset));
    Tensor out = Tensor::empty(*dtype, shape);
    if (nbytes) std::memcpy(out.raw(), bytes.data() + offset, nbytes);
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
