// Writing a file so that a concurrent reader (another thread or process) sees either the old
// content or the whole new one, never a torn file: the disk caches (kernels, the emulator's
// modules, the tuning cache) share it.
#pragma once

#include <filesystem>
#include <string_view>

namespace kg::util {

// Writes `text` to a temporary file beside `path` (unique per process and call, created
// exclusively, links not followed), fsyncs and renames it over `path`. Every write, the fsync and
// the close are checked before the rename, so a full disk never replaces a good file with a
// truncated one. False when the file could not be written; no temporary file is left then.
// `mode` is the new file's permission bits (before the umask).
bool write_file_atomic(const std::filesystem::path& path, std::string_view text, unsigned mode = 0644);

}  // namespace kg::util
