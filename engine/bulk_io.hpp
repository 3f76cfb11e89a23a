// How stage actors move tensors: the sender keeps the bytes in an exported region and sends a
// descriptor; the receiver pulls into memory it owns (transport/bulk.hpp). This wraps the
// process's ucx_link for coroutines.
#pragma once

#include <asio/awaitable.hpp>

#include <cstddef>
#include <memory>
#include <span>

#include "base/result.hpp"
#include "transport/bulk.hpp"
#include "transport/ucx_link.hpp"

namespace moevement::engine {

// A region's memory as floats (the stage actors' tensors).
inline std::span<float> region_floats(const transport::bulk_region& r) {
  auto bytes = r.memory();
  return {reinterpret_cast<float*>(bytes.data()), bytes.size() / sizeof(float)};
}

class bulk_io {
 public:
  explicit bulk_io(transport::ucx_link& link) : link_(link) {}

  // A region of `bytes` the link allocates (shareable by the shared-memory transports).
  transport::bulk_region allocate(std::size_t bytes) { return link_.allocate_region(bytes); }
  // Exports memory the caller owns and keeps unchanged while the region lives (no copy).
  transport::bulk_region export_memory(std::span<std::byte> memory) {
    return link_.export_region(memory);
  }

  // Pulls what `from` names into `into` (exactly from.length bytes). `keep` is held until the
  // transfer has ended, whatever happens to the caller (it owns `into`'s memory).
  asio::awaitable<result<void>> pull(transport::bulk_descriptor from, std::span<std::byte> into,
                                     std::shared_ptr<void> keep);

 private:
  transport::ucx_link& link_;
};

}  // namespace moevement::engine
