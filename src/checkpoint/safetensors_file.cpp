// Memory-mapped, validated safetensors files (POSIX mmap).
//
// The header is validated against the mapped size before any tensor is handed out, so every
// pointer data() returns lies inside the mapping. (A file truncated by another process while
// mapped can still fault, as with any mmap reader; checkpoints are not written in place.)
#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "moe/error.h"
#include "moe/safetensors.h"

namespace moe::safetensors {

std::shared_ptr<const File> File::open(const std::string& path) {
  // Non-blocking: opening a FIFO (or a device) for reading would otherwise wait for a writer; anything
  // but a regular file is refused right after.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  MOE_CHECK(fd >= 0, path, ": cannot open (", std::strerror(errno), ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    detail::throw_error(path, ": not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {  // mmap of an empty file fails; report the format problem instead
    ::close(fd);
    detail::throw_error(path, ": ", size, " bytes, too short for the 8-byte header length");
  }
  void* base = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file alive
  MOE_CHECK(base != MAP_FAILED, path, ": mmap failed (", std::strerror(map_errno), ")");

  std::shared_ptr<File> f(new File());
  f->path_ = path;
  f->base_ = static_cast<const uint8_t*>(base);
  f->size_ = size;
  f->header_ = parse_header(f->base_, size, path);  // on error ~File unmaps
  return f;
}

File::~File() {
  if (base_ != nullptr) ::munmap(const_cast<uint8_t*>(base_), size_);
}

const TensorEntry& File::at(const std::string& name) const {
  const TensorEntry* t = header_.find(name);
  MOE_CHECK(t != nullptr, path_, ": no tensor named '", name, "'");
  return *t;
}

}  // namespace moe::safetensors
