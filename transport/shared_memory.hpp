// Memory shared between the processes of one host, without a copy (Linux memfd).
//
// A snapshot slot on this host need not be copied to be safe from its owner's death: a second
// process that maps the same pages keeps them after the owner is killed. So a replica on the
// owner's host maps the slot (open /proc/<pid>/fd/<fd>, as UCX's own shared-memory transport
// does) instead of pulling it, and a replacement on that host maps the replica's file in turn.
// Handles come from the wire: open() checks the host, then the file's identity and the range
// before mapping, and a handle that names anything else, or another host's process, is
// refused (the caller then pulls the bytes instead).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "base/result.hpp"
#include "transport/bulk.capnp.h"

namespace moevement::transport {

struct share_handle {
  std::int32_t pid = 0;
  std::int32_t fd = -1;
  std::uint64_t device = 0, inode = 0;
  std::uint64_t size = 0;  // of the whole file
  std::uint64_t offset = 0, length = 0;
  std::uint64_t host = 0;  // the owner's host_tag()
  bool operator==(const share_handle&) const = default;
};

// This machine's identity: its kernel's boot id and its host name (UTS namespace), hashed.
// Equal tags: the same kernel and, as far as a process can tell, the same host, whose
// processes' memory files it may open. (Also in the link's bulk addresses.)
std::uint64_t host_tag();

void write_share(wire::ShareHandle::Builder b, const share_handle& h);
result<share_handle> read_share(wire::ShareHandle::Reader r);

class shared_memory {
 public:
  shared_memory() = default;
  ~shared_memory();
  shared_memory(shared_memory&& o) noexcept;
  shared_memory& operator=(shared_memory&& o) noexcept;
  shared_memory(const shared_memory&) = delete;
  shared_memory& operator=(const shared_memory&) = delete;

  // `bytes` of fresh memory (pages are touched on first write). Throws when the host has no
  // memory file to give (say which limit to raise).
  static shared_memory create(std::size_t bytes);
  // Maps the file a handle names, read-write (so that the link can register it, as for a
  // pull's destination) but written by nobody here. An error when the process or its
  // descriptor is gone, the file is another one, or the range is not inside it.
  static result<shared_memory> open(const share_handle& h);

  bool empty() const { return base_ == nullptr; }
  std::span<std::byte> memory() const { return {static_cast<std::byte*>(base_), size_}; }
  // Whether the file is still as long as the mapping (its owner may have cut it since: a read
  // past its end would be a SIGBUS).
  bool whole() const;
  // A handle to [offset, offset + length) of this memory for another process of this host.
  share_handle share(std::uint64_t offset, std::uint64_t length) const;

 private:
  void reset();
  void* base_ = nullptr;
  std::size_t size_ = 0;
  int fd_ = -1;
  std::uint64_t device_ = 0, inode_ = 0;
};

}  // namespace moevement::transport
