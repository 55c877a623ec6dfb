// Writing a file so that it appears complete or not at all (safetensors files, shard indexes).
#pragma once

#include <cstdio>
#include <functional>
#include <string>

namespace moe::detail {

// Writes `path` through a new file beside it (`path`.tmp.<pid>.<n>, created exclusively: an existing
// file, e.g. the input being converted, is never truncated) that is renamed over `path` once `write`
// returned true (a failed or interrupted write never leaves a truncated file under the final name).
// `write` fills the stream and returns false where a write failed (errno set). A symbolic link at
// `path` stays: the file it names is the one replaced. A replaced file keeps its permission bits. An
// existing `path` that is not a regular file (a directory, a device such as /dev/null, a FIFO) is
// refused, as is an empty path. Errors are moe::Errors naming the file.
void write_atomically(const std::string& path, const std::function<bool(std::FILE*)>& write);

}  // namespace moe::detail
