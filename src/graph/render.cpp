// render_dot(): DOT text → .svg/.png/.pdf by running graphviz's `dot`.
#include "graph/render.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kg/error.hpp"
#include "util/file.hpp"
#include "util/str.hpp"

extern char** environ;

namespace kg::dump {
namespace {

namespace fs = std::filesystem;

// A file created with mkstemp, removed when this goes out of scope.
class TempFile {
 public:
  explicit TempFile(const std::string& stem) {
    std::string pattern = (fs::temp_directory_path() / (stem + "-XXXXXX")).string();
    int fd = ::mkstemp(pattern.data());
    if (fd < 0) throw Error(util::cat("render: cannot create a temporary file: ", std::strerror(errno)));
    ::close(fd);
    path_ = pattern;
  }
  ~TempFile() {
    std::error_code ec;
    fs::remove(path_, ec);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Our own temporary files (mkstemp'd, private): written and read by path.
void write_text(const std::string& path, const std::string& text, const std::string& what) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw Error(util::cat(what, ": cannot open '", path, "' for writing: ", std::strerror(errno)));
  f << text;
  f.close();
  if (!f) throw Error(util::cat(what, ": error writing '", path, "'"));
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

// The largest picture graphviz may hand back.
constexpr std::uint64_t kMaxRenderBytes = std::uint64_t{1} << 30;

// The first lines of a program's error output, on one line.
std::string condense(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  while (!text.empty() && text.back() == ' ') text.pop_back();
  if (text.size() > 400) text = text.substr(0, 400) + "...";
  return text;
}

std::string lower_extension(const std::string& path) {
  std::string ext = fs::path(path).extension().string();
  if (!ext.empty() && ext[0] == '.') ext.erase(0, 1);
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext;
}

}  // namespace

std::vector<std::string> render_formats() { return {"svg", "png", "pdf", "dot", "gv"}; }

std::string render_format(const std::string& path) {
  const std::string format = lower_extension(path);
  const auto formats = render_formats();
  if (format.empty())
    throw Error(util::cat("render '", path,
                          "': the file name has no extension to tell the format; use one of .",
                          util::join(formats, ", .")));
  if (std::find(formats.begin(), formats.end(), format) == formats.end())
    throw Error(util::cat("render '", path, "': cannot tell the format from the extension '.", format,
                          "'; use one of .", util::join(formats, ", .")));
  return format;
}

void render_dot(const std::string& dot_text, const std::string& path, const std::string& dot_program) {
  const std::string what = "render '" + path + "'";
  const std::string format = render_format(path);
  // The user's path is written through the safe write (no link followed, no special file
  // replaced); graphviz writes its picture into a temporary file of ours first.
  if (format == "dot" || format == "gv") {
    util::write_file_safely(path, dot_text, what);
    return;
  }

  TempFile input("kg-graph"), errors("kg-dot-stderr"), picture("kg-dot-out");
  write_text(input.path(), dot_text, what);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, errors.path().c_str(), O_WRONLY | O_TRUNC, 0);
  std::vector<std::string> args{dot_program, "-T" + format, "-o", picture.path(), input.path()};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, dot_program.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc == ENOENT)
    throw Error(util::cat(what, ": graphviz's '", dot_program,
                          "' program was not found on PATH; install graphviz (e.g. apt-get install graphviz) "
                          "or write the DOT text to a .dot file and render it elsewhere"));
  if (rc != 0) throw Error(util::cat(what, ": cannot run '", dot_program, "': ", std::strerror(rc)));

  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR)
      throw Error(util::cat(what, ": waiting for '", dot_program, "': ", std::strerror(errno)));
  }
  const std::string command = util::cat(dot_program, " -T", format);
  if (WIFSIGNALED(status))
    throw Error(util::cat(what, ": '", command, "' was killed by signal ", WTERMSIG(status)));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    const std::string err = condense(read_text(errors.path()));
    throw Error(util::cat(what, ": '", command, "' failed with exit status ", WEXITSTATUS(status),
                          err.empty() ? "" : ": ", err));
  }
  util::ReadLimits limits;
  limits.max_bytes = kMaxRenderBytes;
  const std::string bytes = util::read_file(picture.path(), limits);
  if (bytes.empty()) throw Error(util::cat(what, ": '", command, "' succeeded but wrote no file"));
  util::write_file_safely(path, bytes, what);
}

}  // namespace kg::dump
