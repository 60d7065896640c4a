#include "util/file.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <system_error>

#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::util {

namespace fs = std::filesystem;

namespace {

std::string kind_of_mode(mode_t m) {
  if (S_ISREG(m)) return "a regular file";
  if (S_ISDIR(m)) return "a folder";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m) || S_ISBLK(m)) return "a device";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISLNK(m)) return "a symbolic link";
  return "not a regular file";
}

// Why a non-regular file is refused, in the words of the error messages.
std::string not_regular(mode_t m) {
  if (S_ISDIR(m)) return "is a folder, not a file";
  if (S_ISFIFO(m)) return "is a FIFO, not a regular file";
  if (S_ISCHR(m) || S_ISBLK(m)) return "is a device, not a regular file";
  if (S_ISSOCK(m)) return "is a socket, not a regular file";
  return "is not a regular file";
}

// Why open() failed, in words.
std::string open_failure(const fs::path& path, int err, bool follow_links) {
  if (err == ENOENT) return "does not exist";
  if (err == ELOOP && !follow_links) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) return "is a symbolic link (not followed here)";
  }
  if (err == ENOTDIR) return "does not exist (a part of its path is not a folder)";
  if (err == EACCES) return "cannot be read: permission denied";
  if (err == ENXIO) return "is a socket or a device without a reader, not a regular file";
  return cat("cannot be opened: ", std::strerror(err));
}

bool write_all(int fd, std::string_view text, int& err) {
  for (std::size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : ENOSPC;
      return false;
    }
    done += static_cast<std::size_t>(n);
  }
  return true;
}

std::string write_failure(int err) {
  if (err == EFBIG) return "the file-size limit was reached (EFBIG)";
  if (err == ENOSPC) return "the disk is full";
  return std::strerror(err);
}

}  // namespace

std::string describe_path_kind(const fs::path& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return "nothing";
  return kind_of_mode(st.st_mode);
}

// ---------------------------------------------------------------------------------------------
// Reading

bool ReadFile::try_open(const fs::path& path, const ReadLimits& limits, ReadFile& out, std::string* why) {
  out = ReadFile();
  auto fail = [&](std::string reason) {
    if (why) *why = std::move(reason);
    return false;
  };
  // O_NONBLOCK: opening a FIFO without a writer would block forever. Nothing is read before fstat
  // says the file is regular, where the flag changes nothing.
  int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY;
  if (!limits.follow_links) flags |= O_NOFOLLOW;
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) return fail(open_failure(path, errno, limits.follow_links));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return fail(cat("cannot be read: ", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return fail(not_regular(st.st_mode));
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > limits.max_bytes) {
    ::close(fd);
    return fail(cat("is ", size, " bytes, larger than the limit of ", limits.max_bytes, " bytes"));
  }
  out.fd_ = fd;
  out.size_ = size;
  out.path_ = path;
  return true;
}

ReadFile::ReadFile(const fs::path& path, const ReadLimits& limits, std::string_view what) : what_(what) {
  std::string why;
  if (!try_open(path, limits, *this, &why)) throw Error(cat(what, " '", path.string(), "' ", why));
  what_ = what;
}

ReadFile::ReadFile(ReadFile&& o) noexcept
    : fd_(o.fd_), size_(o.size_), path_(std::move(o.path_)), what_(std::move(o.what_)) {
  o.fd_ = -1;
}

ReadFile& ReadFile::operator=(ReadFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    size_ = o.size_;
    path_ = std::move(o.path_);
    what_ = std::move(o.what_);
    o.fd_ = -1;
  }
  return *this;
}

ReadFile::~ReadFile() {
  if (fd_ >= 0) ::close(fd_);
}

void ReadFile::read_at(void* dst, std::uint64_t offset, std::size_t n) const {
  const std::string what = what_.empty() ? std::string("file") : what_;
  if (fd_ < 0) throw Error(cat(what, ": read from a file that is not open"));
  auto* p = static_cast<char*>(dst);
  for (std::size_t done = 0; done < n;) {
    const ssize_t got = ::pread(fd_, p + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0)
      throw Error(cat(what, " '", path_.string(), "': read error at byte ", offset + done, ": ", std::strerror(errno)));
    if (got == 0)
      throw Error(cat(what, " '", path_.string(), "' was cut short while being read: bytes ", offset, "..",
                      offset + n, " were expected, the file ends at byte ", offset + done));
    done += static_cast<std::size_t>(got);
  }
}

std::string ReadFile::read_all() const {
  std::string text(static_cast<std::size_t>(size_), '\0');
  read_at(text.data(), 0, text.size());
  return text;
}

std::string read_file(const fs::path& path, const ReadLimits& limits, std::string_view what) {
  return ReadFile(path, limits, what).read_all();
}

bool try_read_file(const fs::path& path, const ReadLimits& limits, std::string& out, std::string* why) {
  ReadFile f;
  if (!ReadFile::try_open(path, limits, f, why)) return false;
  try {
    out = f.read_all();
  } catch (const Error& e) {
    if (why) *why = e.what();
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Writing

namespace {

// Creates a new temporary file beside `path` (O_EXCL | O_NOFOLLOW); a name taken already (a file
// or link someone planted there) is never opened: the next one is tried. -1 with errno set on failure.
int create_temporary(const fs::path& path, unsigned mode, fs::path& tmp) {
  // The process id and a counter make the temporary name unique, so two threads or processes
  // writing the same file never share one.
  static std::atomic<unsigned> counter{0};
  int fd = -1;
  for (int attempt = 0; attempt < 64 && fd < 0; ++attempt) {
    tmp = path;
    tmp += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd < 0 && errno != EEXIST) break;
  }
  return fd;
}

// "" when `path` is missing or a regular file, else why it is not replaced.
std::string not_replaceable(const fs::path& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    return cat("it is ", kind_of_mode(st.st_mode), ", not a regular file; it is not replaced");
  return {};
}

}  // namespace

AtomicFile::AtomicFile(const fs::path& path, std::string_view what, unsigned mode) : path_(path), what_(what) {
  if (std::string why = not_replaceable(path); !why.empty()) fail(why);
  fd_ = create_temporary(path, mode, tmp_);
  if (fd_ < 0) {
    const int err = errno;
    tmp_.clear();
    fail(cat("cannot create a temporary file beside it: ", std::strerror(err)));
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

void AtomicFile::fail(const std::string& why) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
  tmp_.clear();
  throw Error(cat("cannot write the ", what_, " '", path_.string(), "': ", why, " ('", path_.string(),
                  "' is left as it was)"));
}

void AtomicFile::write(const void* data, std::size_t n) {
  if (fd_ < 0) fail("the file is not open");
  int err = 0;
  if (!write_all(fd_, std::string_view(static_cast<const char*>(data), n), err)) fail(write_failure(err));
}

void AtomicFile::commit() {
  if (fd_ < 0) fail("the file is not open");
  if (::fsync(fd_) != 0) fail(write_failure(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail(write_failure(errno));
  // Checked again just before the rename: a folder or link put there meanwhile is not replaced.
  if (std::string why = not_replaceable(path_); !why.empty()) fail(why);
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail(cat("cannot rename the temporary file over it: ", std::strerror(errno)));
  tmp_.clear();
}

bool write_file_atomic(const fs::path& path, std::string_view text, unsigned mode, std::string* why) {
  try {
    AtomicFile f(path, "file", mode);
    f.write(text);
    f.commit();
    return true;
  } catch (const Error& e) {
    if (why) {
      // The reason alone: the part after "cannot write the file '<path>': ".
      const std::string full = e.what(), head = cat("cannot write the file '", path.string(), "': ");
      *why = full.rfind(head, 0) == 0 ? full.substr(head.size()) : full;
    }
    return false;
  }
}

void write_file_safely(const fs::path& path, std::string_view text, std::string_view what, unsigned mode) {
  AtomicFile f(path, what, mode);
  f.write(text);
  f.commit();
}

void check_output_path(const fs::path& path, std::string_view what) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw Error(cat("the ", what, " '", path.string(), "' is ", kind_of_mode(st.st_mode),
                    ", not a regular file; it is not replaced"));
}

AppendFile::AppendFile(const fs::path& path, unsigned mode) : path_(path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY, mode);
  if (fd < 0) {
    const int err = errno;
    throw Error(cat("cannot write '", path.string(), "': ",
                    err == ELOOP ? std::string("it is a symbolic link (not followed)") : open_failure(path, err, false)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const std::string kind = kind_of_mode(st.st_mode);
    ::close(fd);
    throw Error(cat("cannot write '", path.string(), "': it is ", kind, ", not a regular file"));
  }
  // Regular: the non-blocking flag is dropped, and the old content with it.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  if (::ftruncate(fd, 0) != 0) {
    const int err = errno;
    ::close(fd);
    throw Error(cat("cannot write '", path.string(), "': ", std::strerror(err)));
  }
  fd_ = fd;
}

AppendFile::AppendFile(AppendFile&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }

AppendFile& AppendFile::operator=(AppendFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    o.fd_ = -1;
  }
  return *this;
}

AppendFile::~AppendFile() {
  if (fd_ >= 0) ::close(fd_);
}

void AppendFile::write(std::string_view text) {
  if (fd_ < 0) throw Error(cat("cannot write '", path_.string(), "': the file is not open"));
  int err = 0;
  if (!write_all(fd_, text, err))
    throw Error(cat("cannot write '", path_.string(), "': ", write_failure(err)));
}

void AppendFile::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0)
    throw Error(cat("cannot write '", path_.string(), "': ", write_failure(errno)));
}

void ignore_file_size_signal() { ::signal(SIGXFSZ, SIG_IGN); }

// ---------------------------------------------------------------------------------------------
// Private folders

bool private_dir(const fs::path& dir, std::string& why) {
  if (dir.empty()) {
    why = "no folder was given";
    return false;
  }
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    why = cat("it cannot be created: ", std::strerror(errno));
    return false;
  }
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    why = cat("it cannot be read: ", std::strerror(errno));
    return false;
  }
  if (!S_ISDIR(st.st_mode)) {
    why = S_ISLNK(st.st_mode) ? "it is a symbolic link, not a folder" : "it is not a folder";
    return false;
  }
  if (st.st_uid != ::geteuid()) {
    why = cat("it is owned by uid ", st.st_uid, ", not by this user (uid ", ::geteuid(), ")");
    return false;
  }
  if ((st.st_mode & 022) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    why = cat("it is writable by group or others (mode ", mode, ")");
    return false;
  }
  return true;
}

bool private_subdir(const fs::path& base, const fs::path& sub, std::string& why, fs::path* out) {
  if (!private_dir(base, why)) {
    why = cat("'", base.string(), "': ", why);
    return false;
  }
  fs::path at = base;
  for (const fs::path& part : sub.relative_path()) {
    if (part.empty() || part == "." ) continue;
    if (part == "..") {
      why = cat("'", (base / sub).string(), "': a subfolder may not go up ('..')");
      return false;
    }
    at /= part;
    if (!private_dir(at, why)) {
      why = cat("'", at.string(), "': ", why);
      return false;
    }
  }
  if (out) *out = at;
  return true;
}

}  // namespace kg::util
