// Every file the library or the CLI reads from elsewhere, every file it writes and every cache
// folder it keeps code in goes through these helpers, so that one set of rules holds everywhere:
//
// - Reading: a regular file only. The file is opened with O_NONBLOCK (a FIFO never blocks the
//   open) and checked with fstat before a byte is read, so a folder, a FIFO or a device node is
//   named as such (never "does not exist", never a hang, never an endless /dev/zero); the caller
//   gives the largest size it accepts, and a larger file is refused before it is read.
// - Writing: a new temporary file beside the target (O_EXCL | O_NOFOLLOW: nothing planted at its
//   name is followed), every write, the fsync and the close checked, then a rename over the target.
//   A target that exists and is not a regular file (a device node, a FIFO, a folder, a symbolic
//   link) is refused, never replaced. Logs written over time go through AppendFile, opened the same
//   careful way.
// - Cache folders whose files are later loaded as code: private_dir() says whether a folder (and
//   each subfolder on the way) is owned by this user, not writable by group or others and not a
//   symbolic link.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace kg::util {

// How a read file is opened.
struct ReadLimits {
  // The largest file accepted, in bytes.
  std::uint64_t max_bytes = std::uint64_t(1) << 30;
  // false: a symbolic link at the path is refused (O_NOFOLLOW).
  bool follow_links = true;
};

// A regular file opened for reading (see above). Moves, closes on destruction.
class ReadFile {
 public:
  // Opens `path`; throws kg::Error naming `what` (e.g. "safetensors file"), the path and why:
  // "does not exist", "is a folder, not a file", "is a FIFO, not a regular file", "is a device,
  // not a regular file", "is a symbolic link", "is N bytes, larger than the limit of M bytes", ...
  ReadFile(const std::filesystem::path& path, const ReadLimits& limits = {}, std::string_view what = "file");
  // Like the constructor, but returns false (with the reason in `why` when given) instead of
  // throwing; `out` is then closed.
  static bool try_open(const std::filesystem::path& path, const ReadLimits& limits, ReadFile& out,
                       std::string* why = nullptr);
  ReadFile() = default;
  ReadFile(ReadFile&& o) noexcept;
  ReadFile& operator=(ReadFile&& o) noexcept;
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;
  ~ReadFile();

  bool is_open() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  // The size fstat gave at open.
  std::uint64_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }
  // The whole file (at most the size seen at open). Throws kg::Error on a read error or when the
  // file shrank while being read.
  std::string read_all() const;
  // `n` bytes from `offset` into `dst`; throws kg::Error when the range is not all there (the file
  // was cut short since it was opened) or on a read error.
  void read_at(void* dst, std::uint64_t offset, std::size_t n) const;

 private:
  int fd_ = -1;
  std::uint64_t size_ = 0;
  std::filesystem::path path_;
  std::string what_;
};

// The whole of a regular file no larger than `limits.max_bytes`; throws kg::Error (see ReadFile).
std::string read_file(const std::filesystem::path& path, const ReadLimits& limits = {},
                      std::string_view what = "file");
// Like read_file(), but false (and the reason in `why` when given) when the file is missing, not a
// regular file, too large or unreadable: for caches, where any of these is just a miss.
bool try_read_file(const std::filesystem::path& path, const ReadLimits& limits, std::string& out,
                   std::string* why = nullptr);

// What is at `path` (not following a symbolic link), in words for an error message: "a folder",
// "a FIFO", "a device", "a socket", "a symbolic link", "a regular file", or "nothing".
std::string describe_path_kind(const std::filesystem::path& path);

// Writes `text` to a temporary file beside `path` (unique per process and call, created
// exclusively, links not followed), fsyncs and renames it over `path`. Every write, the fsync and
// the close are checked before the rename, so a full disk never replaces a good file with a
// truncated one. False when the file could not be written or when `path` exists and is not a
// regular file; no temporary file is left then. `mode` is the new file's permission bits (before
// the umask). `why`, when given, gets the reason on failure.
bool write_file_atomic(const std::filesystem::path& path, std::string_view text, unsigned mode = 0644,
                       std::string* why = nullptr);
// A file written in pieces and put in place whole: the temporary of write_file_atomic() (created
// new beside `path`, O_EXCL | O_NOFOLLOW), written with write(), then commit() fsyncs, checks that
// `path` is not (or is no longer) anything but a regular file, and renames. Without commit() (an
// error, an exception) the temporary is removed. Errors throw kg::Error naming `what` and the path.
class AtomicFile {
 public:
  explicit AtomicFile(const std::filesystem::path& path, std::string_view what = "output", unsigned mode = 0644);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();
  void write(const void* data, std::size_t n);
  void write(std::string_view text) { write(text.data(), text.size()); }
  void commit();

 private:
  [[noreturn]] void fail(const std::string& why);
  std::filesystem::path path_, tmp_;
  std::string what_;
  int fd_ = -1;
};

// write_file_atomic() for outputs the user named: throws kg::Error naming `what` and the path.
void write_file_safely(const std::filesystem::path& path, std::string_view text, std::string_view what = "output",
                       unsigned mode = 0644);
// Throws kg::Error when `path` exists and is not a regular file (a symbolic link, a folder, a FIFO,
// a device): for outputs checked before work whose result would be written there.
void check_output_path(const std::filesystem::path& path, std::string_view what = "output");

// A log written over time (a CSV of epochs, a tool's output): opened with O_NOFOLLOW and
// O_NONBLOCK, refused unless it is a regular file, truncated on open. Every write is checked and
// throws kg::Error naming the file (a full disk, a file-size limit: EFBIG).
class AppendFile {
 public:
  AppendFile() = default;
  explicit AppendFile(const std::filesystem::path& path, unsigned mode = 0644);
  AppendFile(AppendFile&& o) noexcept;
  AppendFile& operator=(AppendFile&& o) noexcept;
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;
  ~AppendFile();
  bool is_open() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  void write(std::string_view text);
  // Closes the file; throws kg::Error when the close reports a lost write.
  void close();
  const std::filesystem::path& path() const { return path_; }

 private:
  int fd_ = -1;
  std::filesystem::path path_;
};

// A signal a file-size limit (ulimit -f) would raise on a write past it: ignored, so the write fails
// with EFBIG and is reported (and the temporary file removed) instead of the process dying with a
// core. For programs (the CLI); a library leaves signal dispositions to its host.
void ignore_file_size_signal();

// Creates `dir` (mode 0700) when it is missing, and says whether it is safe to keep files in that
// are later loaded as code: a folder (not a symbolic link) owned by this user and not writable by
// group or others. `why` gets the reason when it is not.
bool private_dir(const std::filesystem::path& dir, std::string& why);
// private_dir() for `base` and then for every folder of `sub` under it, in order (`base`/emu, or
// `base`/a/b: `base`/a, then `base`/a/b), so that a subfolder that is a symbolic link elsewhere, or
// another user's, is refused too. On success `out` (when given) is base / sub.
bool private_subdir(const std::filesystem::path& base, const std::filesystem::path& sub, std::string& why,
                    std::filesystem::path* out = nullptr);

}  // namespace kg::util
