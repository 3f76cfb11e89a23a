#include "recovery/atomic_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>

namespace moevement::recovery {
namespace {

[[noreturn]] void fail(const std::string& what, const std::filesystem::path& p) {
  throw std::runtime_error(fmt::format("{} {}: {}", what, p.string(), std::strerror(errno)));
}

// Owns one file descriptor.
class fd_guard {
 public:
  explicit fd_guard(int fd) : fd_(fd) {}
  ~fd_guard() {
    if (fd_ >= 0) ::close(fd_);
  }
  fd_guard(const fd_guard&) = delete;
  fd_guard& operator=(const fd_guard&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

}  // namespace

void write_file_atomically(const std::filesystem::path& target, std::span<const std::byte> bytes) {
  const std::filesystem::path dir =
      target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  // The temp name is unique per process and call so concurrent writers never share one.
  std::random_device rd;
  const std::filesystem::path tmp =
      dir / fmt::format(".{}.tmp.{}.{:08x}", target.filename().string(), ::getpid(), rd());
  fd_guard fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (fd.get() < 0) fail("cannot create", tmp);
  if (::fchmod(fd.get(), 0600) != 0) {  // the umask may have taken more than group and other
    const int saved = errno;
    ::unlink(tmp.c_str());
    errno = saved;
    fail("cannot set the mode of", tmp);
  }
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int saved = errno;
      ::unlink(tmp.c_str());
      errno = saved;
      fail("cannot write", tmp);
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd.get()) != 0 || ::close(fd.release()) != 0) {
    const int saved = errno;
    ::unlink(tmp.c_str());
    errno = saved;
    fail("cannot flush", tmp);
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const int saved = errno;
    ::unlink(tmp.c_str());
    errno = saved;
    fail("cannot rename into place", target);
  }
  sync_directory(dir);
}

void sync_directory(const std::filesystem::path& dir) {
  fd_guard dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() < 0 || ::fsync(dfd.get()) != 0) fail("cannot fsync directory", dir);
}

void create_private_directories(const std::filesystem::path& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  if (std::filesystem::is_directory(dir, ec)) return;
  if (dir.has_parent_path() && dir.parent_path() != dir) {
    create_private_directories(dir.parent_path());
  }
  if (::mkdir(dir.c_str(), 0700) != 0) {
    if (errno == EEXIST && std::filesystem::is_directory(dir, ec)) return;  // a racing writer
    fail("cannot create directory", dir);
  }
  if (::chmod(dir.c_str(), 0700) != 0) fail("cannot set the mode of", dir);
}

result<std::vector<std::byte>> read_whole_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return error{fmt::format("cannot open {}: {}", path.string(), std::strerror(errno))};
  in.seekg(0, std::ios::end);
  const auto size = static_cast<std::size_t>(in.tellg());
  in.seekg(0);
  std::vector<std::byte> out(size);
  if (!in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(size))) {
    return error{fmt::format("cannot read {} ({} bytes expected)", path.string(), size)};
  }
  return out;
}

}  // namespace moevement::recovery
