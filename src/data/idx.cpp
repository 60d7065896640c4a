// The IDX file format (MNIST's), read and written through zlib's gz* functions, which also read
// uncompressed files as they are.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>

#include "kg/data.hpp"
#include "util/file.hpp"
#include "util/memory.hpp"
#include "util/str.hpp"

namespace kg::data {
namespace {

// Largest payload accepted (64 GiB): anything above is taken for a corrupt header.
constexpr std::uint64_t kMaxPayload = std::uint64_t{1} << 36;
// Deflate cannot compress by more than about 1032:1.
constexpr std::uint64_t kMaxDeflateRatio = 1100;

struct IdxType {
  std::uint8_t code;
  DType dtype;
};
constexpr IdxType kTypes[] = {{0x08, DType::U8},  {0x09, DType::I8},  {0x0B, DType::I16},
                              {0x0C, DType::I32}, {0x0D, DType::F32}, {0x0E, DType::F64}};

std::string hex_byte(unsigned v) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "0x%02X", v & 0xFFu);
  return buf;
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw Error(util::cat("IDX file '", path, "': ", what));
}

struct GzCloser {
  void operator()(gzFile f) const {
    if (f) gzclose(f);
  }
};
using GzPtr = std::unique_ptr<gzFile_s, GzCloser>;

bool is_gzip(int fd) {
  unsigned char m[2] = {0, 0};
  ssize_t r;
  do r = ::pread(fd, m, 2, 0);
  while (r < 0 && errno == EINTR);
  return r == 2 && m[0] == 0x1F && m[1] == 0x8B;
}

// zlib's message without the file name it starts with.
std::string zlib_message(const char* msg, const std::string& path, const char* fallback) {
  std::string m = msg && *msg ? msg : fallback;
  if (m.rfind(path + ": ", 0) == 0) m.erase(0, path.size() + 2);
  return m;
}

// Reads up to n bytes; the number read. Stream errors are kg::Errors naming the file.
std::uint64_t read_some(gzFile f, const std::string& path, bool gzip, void* dst, std::uint64_t n) {
  auto* out = static_cast<unsigned char*>(dst);
  std::uint64_t got = 0;
  while (got < n) {
    const auto chunk = static_cast<unsigned>(std::min<std::uint64_t>(n - got, 1u << 30));
    const int r = gzread(f, out + got, chunk);
    int errnum = Z_OK;
    const char* msg = gzerror(f, &errnum);
    if (r < 0 || (errnum != Z_OK && errnum != Z_STREAM_END)) {
      if (gzip && errnum == Z_BUF_ERROR)
        fail(path, util::cat("truncated gzip stream (zlib: ",
                             zlib_message(msg, path, "unexpected end of file"), ")"));
      if (gzip)
        fail(path, util::cat("corrupt gzip stream (zlib: ", zlib_message(msg, path, "unknown error"), ")"));
      fail(path, util::cat("read error: ", zlib_message(msg, path, "unknown error")));
    }
    if (r == 0) break;
    got += static_cast<std::uint64_t>(r);
  }
  return got;
}

void swap_bytes(unsigned char* p, std::uint64_t count, std::size_t width) {
  if (width == 1 || std::endian::native == std::endian::big) return;
  for (std::uint64_t i = 0; i < count; ++i) std::reverse(p + i * width, p + (i + 1) * width);
}

}  // namespace

Tensor read_idx(const std::string& path) {
  // One descriptor for the checks and the reads. O_NONBLOCK: opening a FIFO must not wait for a
  // writer before the regular-file check rejects it; the flag is cleared before reading.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT) fail(path, "cannot open it (no such file)");
    fail(path, util::cat("cannot open it for reading: ", std::strerror(errno)));
  }
  struct stat st {};
  const bool stat_ok = ::fstat(fd, &st) == 0;
  if (!stat_ok || !S_ISREG(st.st_mode)) {
    ::close(fd);
    if (!stat_ok) fail(path, "cannot stat it");
    if (S_ISDIR(st.st_mode)) fail(path, "is a folder, not a file");
    fail(path, "not a regular file (a FIFO, socket or device cannot be read as IDX)");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    ::close(fd);
    fail(path, "cannot open it for reading");
  }
  const auto file_bytes = static_cast<std::uint64_t>(st.st_size);
  const bool gzip = is_gzip(fd);
  GzPtr f(gzdopen(fd, "rb"));  // owns fd from here on
  if (!f) {
    ::close(fd);
    fail(path, "cannot open it for reading");
  }
  gzbuffer(f.get(), 1 << 17);

  unsigned char head[4];
  const std::uint64_t got_head = read_some(f.get(), path, gzip, head, 4);
  if (got_head < 4)
    fail(path,
         util::cat("too short for an IDX header: ", got_head, " bytes where the header needs at least 4"));
  if (head[0] != 0 || head[1] != 0)
    fail(path, util::cat("bad magic ", hex_byte(head[0]), " ", hex_byte(head[1]), " ", hex_byte(head[2]), " ",
                         hex_byte(head[3]),
                         ": an IDX file starts with two zero bytes, a type byte and the "
                         "number of dims"));
  const IdxType* type = nullptr;
  for (const IdxType& t : kTypes)
    if (t.code == head[2]) type = &t;
  if (!type)
    fail(path, util::cat("unknown element type ", hex_byte(head[2]),
                         " (known: 0x08 u8, 0x09 i8, 0x0B i16, 0x0C i32, 0x0D f32, 0x0E f64)"));
  const unsigned ndims = head[3];
  if (ndims == 0) fail(path, "has 0 dims; an IDX tensor has at least one");

  std::vector<unsigned char> dim_bytes(4u * ndims);
  const std::uint64_t got_dims = read_some(f.get(), path, gzip, dim_bytes.data(), dim_bytes.size());
  if (got_dims < dim_bytes.size())
    fail(path, util::cat("the header ends inside the dims: ", ndims, " dims need ", dim_bytes.size(),
                         " bytes after the magic, the file has ", got_dims));
  std::vector<std::int64_t> shape(ndims);
  const std::size_t width = dtype_size(type->dtype);
  // Checked products: the element count and the byte count must fit an int64 (the tensor's
  // numel), and so must the product of the non-zero dims, so that a zero dim does not hide a
  // product that overflows in the strides or in any partial product.
  std::uint64_t numel = 1, nonzero = 1;
  bool overflow = false, has_zero = false;
  for (unsigned d = 0; d < ndims; ++d) {
    const unsigned char* b = &dim_bytes[4u * d];
    const std::uint64_t v =
        (std::uint64_t{b[0]} << 24) | (std::uint64_t{b[1]} << 16) | (std::uint64_t{b[2]} << 8) | b[3];
    shape[d] = static_cast<std::int64_t>(v);
    if (v == 0)
      has_zero = true;
    else if (__builtin_mul_overflow(nonzero, v, &nonzero) ||
             nonzero > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      overflow = true;
  }
  std::uint64_t nonzero_bytes = 0;
  if (!overflow && __builtin_mul_overflow(nonzero, std::uint64_t{width}, &nonzero_bytes)) overflow = true;
  numel = has_zero ? 0 : nonzero;
  const std::uint64_t header = 4 + 4ull * ndims;
  const std::uint64_t need = overflow ? std::numeric_limits<std::uint64_t>::max() : numel * width;
  const std::string dims_text = util::cat(sizes_to_string(shape), " of ", dtype_name(type->dtype));
  if (overflow || need > kMaxPayload)
    fail(path, util::cat("absurd dims ", dims_text, ": ",
                         overflow ? std::string("the sizes overflow, more than 2^64 bytes or 2^63 - 1 elements")
                                  : util::cat(need, " bytes"),
                         " of payload (the limit is ", kMaxPayload, " bytes)"));
  if (!gzip && need > file_bytes - header)
    fail(path,
         util::cat("payload shorter than the dims say: dims ", dims_text, " need ", need,
                   " bytes, the file has ", file_bytes - header, " after the ", header, "-byte header"));
  if (gzip && need > file_bytes * kMaxDeflateRatio + (1u << 20))
    fail(path, util::cat("absurd dims ", dims_text, ": ", need, " bytes of payload cannot come from ",
                         file_bytes, " bytes of gzip data"));

  // The payload is allocated whole before it is decompressed: a gzip bomb (a small file whose
  // header claims gigabytes, within the deflate ratio) must meet the memory check first, like a
  // memory plan, not the OOM killer.
  if (!util::memory_check_disabled())
    if (const auto avail = util::available_memory(); avail && need > avail->bytes)
      fail(path, util::cat("dims ", dims_text, " need ", need, " bytes (", util::format_bytes(need),
                           ") of payload, but ", avail->bytes, " bytes (", util::format_bytes(avail->bytes),
                           ") are available (", avail->source,
                           "); set KG_NO_MEMORY_CHECK=1 to read it anyway"));
  Tensor t = Tensor::empty(type->dtype, shape);
  auto* data = static_cast<unsigned char*>(t.raw());
  const std::uint64_t got = read_some(f.get(), path, gzip, data, need);
  if (got < need)
    fail(path, util::cat("payload shorter than the dims say: dims ", dims_text, " need ", need,
                         " bytes, the ", gzip ? "decompressed data has " : "file has ", got, " after the ",
                         header, "-byte header"));
  // Anything after the payload means the dims do not describe the file.
  std::uint64_t extra = 0;
  unsigned char sink[1 << 12];
  for (;;) {
    const std::uint64_t r = read_some(f.get(), path, gzip, sink, sizeof sink);
    if (r == 0) break;
    extra += r;
  }
  if (extra > 0)
    fail(path, util::cat("payload longer than the dims say: dims ", dims_text, " need ", need, " bytes, the ",
                         gzip ? "decompressed data has " : "file has ", need + extra, " after the ", header,
                         "-byte header (", extra, " extra)"));
  swap_bytes(data, numel, width);
  return t;
}

void write_idx(const std::string& path, const Tensor& t, bool gzip) {
  const IdxType* type = nullptr;
  for (const IdxType& k : kTypes)
    if (k.dtype == t.dtype()) type = &k;
  if (!type)
    throw Error(util::cat("write_idx '", path, "': IDX has no element type for ", dtype_name(t.dtype()),
                          " (u8, i8, i16, i32, f32, f64)"));
  if (t.rank() == 0 || t.rank() > 255)
    throw Error(util::cat("write_idx '", path, "': IDX takes 1 to 255 dims, the tensor has ", t.rank()));
  std::vector<unsigned char> bytes{0, 0, type->code, static_cast<unsigned char>(t.rank())};
  for (std::int64_t d : t.shape()) {
    if (d < 0 || d > 0xFFFFFFFFll)
      throw Error(util::cat("write_idx '", path, "': dim ", d, " does not fit IDX's 32-bit dims"));
    const auto v = static_cast<std::uint32_t>(d);
    for (int s = 24; s >= 0; s -= 8) bytes.push_back(static_cast<unsigned char>((v >> s) & 0xFFu));
  }
  const std::size_t head = bytes.size();
  bytes.resize(head + t.nbytes());
  if (t.nbytes()) std::memcpy(bytes.data() + head, t.raw(), t.nbytes());
  swap_bytes(bytes.data() + head, static_cast<std::uint64_t>(t.numel()), dtype_size(t.dtype()));

  if (!gzip) {
    util::write_file_safely(path, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                            "IDX file");
    return;
  }
  // Compressed in memory (a gzip stream: windowBits 15 + 16), then written like the plain file, so
  // that a link or special file at `path` is refused rather than written through.
  z_stream z{};
  if (deflateInit2(&z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK)
    throw Error(util::cat("write_idx '", path, "': zlib could not start a gzip stream"));
  std::string out;
  std::size_t done = 0;
  int rc = Z_OK;
  unsigned char buf[1 << 16];
  do {
    const auto chunk = static_cast<uInt>(std::min<std::size_t>(bytes.size() - done, 1u << 30));
    z.next_in = bytes.data() + done;
    z.avail_in = chunk;
    done += chunk;
    const int flush = done == bytes.size() ? Z_FINISH : Z_NO_FLUSH;
    do {
      z.next_out = buf;
      z.avail_out = sizeof buf;
      rc = deflate(&z, flush);
      out.append(reinterpret_cast<const char*>(buf), sizeof buf - z.avail_out);
    } while (z.avail_out == 0 && rc != Z_STREAM_ERROR);
  } while (done < bytes.size() && rc != Z_STREAM_ERROR);
  deflateEnd(&z);
  if (rc != Z_STREAM_END) throw Error(util::cat("write_idx '", path, "': zlib failed to compress the data"));
  util::write_file_safely(path, out, "IDX file");
}

}  // namespace kg::data
