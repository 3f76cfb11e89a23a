#include "transport/shared_memory.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "base/hash.hpp"

namespace moevement::transport {

std::uint64_t host_tag() {
  static const std::uint64_t tag = [] {
    std::string id;
    if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
      char buf[64] = {};
      if (std::fgets(buf, sizeof buf, f) != nullptr) id = buf;
      std::fclose(f);
    }
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) == 0) id += host;
    return xxhash64(std::as_bytes(std::span(id.data(), id.size())), 0x6d6f6576);
  }();
  return tag;
}

void write_share(wire::ShareHandle::Builder b, const share_handle& h) {
  b.setPid(h.pid);
  b.setFd(h.fd);
  b.setDevice(h.device);
  b.setInode(h.inode);
  b.setSize(h.size);
  b.setOffset(h.offset);
  b.setLength(h.length);
  b.setHost(h.host);
}

result<share_handle> read_share(wire::ShareHandle::Reader r) {
  share_handle h{r.getPid(),  r.getFd(),     r.getDevice(), r.getInode(),
                 r.getSize(), r.getOffset(), r.getLength(), r.getHost()};
  if (h.pid <= 0 || h.fd < 0) return error{"share handle names no process or descriptor"};
  if (h.length == 0 || h.offset + h.length < h.offset || h.offset + h.length > h.size) {
    return error{"share handle's range is not inside its file"};
  }
  return h;
}

shared_memory::~shared_memory() {
  reset();
}

shared_memory::shared_memory(shared_memory&& o) noexcept
    : base_(std::exchange(o.base_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      fd_(std::exchange(o.fd_, -1)),
      device_(o.device_),
      inode_(o.inode_) {}

shared_memory& shared_memory::operator=(shared_memory&& o) noexcept {
  if (this != &o) {
    reset();
    base_ = std::exchange(o.base_, nullptr);
    size_ = std::exchange(o.size_, 0);
    fd_ = std::exchange(o.fd_, -1);
    device_ = o.device_;
    inode_ = o.inode_;
  }
  return *this;
}

void shared_memory::reset() {
  if (base_ != nullptr) ::munmap(base_, size_);
  if (fd_ >= 0) ::close(fd_);
  base_ = nullptr;
  size_ = 0;
  fd_ = -1;
}

shared_memory shared_memory::create(std::size_t bytes) {
  if (bytes == 0) throw std::invalid_argument("shared_memory::create: zero bytes");
  const int fd = ::memfd_create("moevement-slot", MFD_CLOEXEC);
  if (fd < 0) {
    throw std::runtime_error(fmt::format(
        "memfd_create failed ({}): this host cannot share memory between processes; set "
        "checkpoint.share_memory = false",
        std::strerror(errno)));
  }
  shared_memory m;
  m.fd_ = fd;
  (void)::fchmod(fd, 0600);  // training state: the owner only (a memory file starts at 0777)
  if (::ftruncate(fd, off_t(bytes)) != 0) {
    throw std::runtime_error(
        fmt::format("cannot size a {}-byte shared memory file ({}): raise "
                    "the size of /dev/shm or lower the model's size",
                    bytes, std::strerror(errno)));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw std::runtime_error(
        fmt::format("cannot map {} bytes of shared memory ({})", bytes, std::strerror(errno)));
  }
  m.base_ = p;
  m.size_ = bytes;
  struct stat st {};
  if (::fstat(fd, &st) == 0) {
    m.device_ = std::uint64_t(st.st_dev);
    m.inode_ = std::uint64_t(st.st_ino);
  }
  return m;
}

result<shared_memory> shared_memory::open(const share_handle& h) {
  if (h.pid <= 0 || h.fd < 0 || h.length == 0 || h.offset + h.length < h.offset ||
      h.offset + h.length > h.size) {
    return error{"share handle is malformed"};
  }
  // Another host's pid and descriptor would name some process of this one: never opened.
  if (h.host != host_tag()) return error{"share handle is from another host"};
  const std::string path = fmt::format("/proc/{}/fd/{}", h.pid, h.fd);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return error{fmt::format("cannot open the shared memory of process {} ({})", h.pid,
                             std::strerror(errno))};
  }
  shared_memory m;
  m.fd_ = fd;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || std::uint64_t(st.st_dev) != h.device ||
      std::uint64_t(st.st_ino) != h.inode) {
    return error{fmt::format("process {}'s descriptor {} is not the memory named", h.pid, h.fd)};
  }
  // Memory files only (memfd, tmpfs): a handle must never make us map a file on disk.
  if (::fcntl(fd, F_GET_SEALS) < 0) {
    return error{fmt::format("process {}'s descriptor {} is not shared memory", h.pid, h.fd)};
  }
  if (std::uint64_t(st.st_size) != h.size) {
    return error{fmt::format("process {}'s shared memory is {} bytes, the handle says {}", h.pid,
                             std::uint64_t(st.st_size), h.size)};
  }
  void* p = ::mmap(nullptr, h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return error{
        fmt::format("cannot map process {}'s shared memory ({})", h.pid, std::strerror(errno))};
  }
  m.base_ = p;
  m.size_ = h.size;
  m.device_ = h.device;
  m.inode_ = h.inode;
  return m;
}

bool shared_memory::whole() const {
  struct stat st {};
  return fd_ >= 0 && ::fstat(fd_, &st) == 0 && std::uint64_t(st.st_size) == size_;
}

share_handle shared_memory::share(std::uint64_t offset, std::uint64_t length) const {
  if (offset + length < offset || offset + length > size_) {
    throw std::out_of_range("shared_memory::share: range outside the memory");
  }
  return share_handle{
      std::int32_t(::getpid()), fd_, device_, inode_, size_, offset, length, host_tag()};
}

}  // namespace moevement::transport
