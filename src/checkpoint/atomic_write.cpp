// write_atomically (checkpoint/atomic_write.h): a temporary file beside the target, renamed over it.
#include "checkpoint/atomic_write.h"

#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "moe/error.h"

namespace moe::detail {

namespace {

// Where the file goes: `path`, or the file a symbolic link there points to (so that the link stays
// and the file it names gets the data), with the permission bits to give it: the existing file's,
// or 0666 less the umask for a new one. Refuses an existing target that is not a regular file (a
// rename over a device, FIFO or directory entry would replace it) and a link that resolves nowhere.
struct WriteTarget {
  std::string path;
  bool exists = false;
  mode_t mode = 0;
};

WriteTarget write_target(const std::string& path) {
  MOE_CHECK(!path.empty(), "argument 'path': the output file name is empty");
  WriteTarget t{path};
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    MOE_CHECK(errno == ENOENT, path, ": cannot inspect the output path (", std::strerror(errno), ")");
    return t;  // a new file
  }
  if (S_ISLNK(st.st_mode)) {
    char resolved[PATH_MAX];
    MOE_CHECK(::realpath(path.c_str(), resolved) != nullptr, path, ": a symbolic link whose target cannot be ",
              "resolved (", std::strerror(errno), "); give the target's path");
    t.path = resolved;
    MOE_CHECK(::stat(t.path.c_str(), &st) == 0, path, ": cannot inspect ", t.path, " (", std::strerror(errno), ")");
  }
  MOE_CHECK(S_ISREG(st.st_mode), path, ": exists and is not a regular file (a directory, device or FIFO); ",
            "refusing to replace it");
  t.exists = true;
  t.mode = st.st_mode & 07777;
  return t;
}

}  // namespace

void write_atomically(const std::string& path, const std::function<bool(std::FILE*)>& write) {
  // Created exclusively (O_EXCL), never opened over an existing file: the input being converted may
  // carry that name, or a link may stand there, and truncating it would pull the data from under its
  // mapping.
  const WriteTarget target = write_target(path);
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    tmp = target.path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(attempt);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    MOE_CHECK(fd >= 0 || (errno == EEXIST && attempt < 1000), path, ": cannot create the file beside it that is ",
              "renamed over it when complete, ", tmp, " (", std::strerror(errno), ")");
  }
  // A replaced file keeps its permissions (the new one would get 0666 less the umask). Best effort: a
  // file system without permission bits (vfat, some FUSE mounts) refuses fchmod, and the write goes on.
  if (target.exists) (void)::fchmod(fd, target.mode);
  std::FILE* f = ::fdopen(fd, "wb");
  if (f == nullptr) {
    const int err = errno;
    ::close(fd);
    std::remove(tmp.c_str());
    throw_error(tmp, ": cannot open for writing (", std::strerror(err), ")");
  }
  bool written = false;
  try {
    written = write(f) && std::fflush(f) == 0 && !std::ferror(f);
  } catch (...) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
  if (!written) {
    const int err = errno;
    std::fclose(f);
    std::remove(tmp.c_str());
    throw_error(tmp, ": write failed (", std::strerror(err), ")");
  }
  if (std::fclose(f) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw_error(tmp, ": close failed (", std::strerror(err), ")");
  }
  if (std::rename(tmp.c_str(), target.path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw_error(path, ": cannot rename ", tmp, " into place (", std::strerror(err), ")");
  }
}

}  // namespace moe::detail
