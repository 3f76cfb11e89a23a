// Bulk regions: registered memory a node exports so that peers can pull from it.
// A bulk_descriptor names bytes inside one exported region of one node. It travels inside
// envelopes (wire::BulkDescriptor); the exporter checks each pull against its own region
// table (region id exists, offset + length within it), so nothing the wire says is trusted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "base/result.hpp"
#include "transport/bulk.capnp.h"

namespace moevement::transport {

struct bulk_descriptor {
  std::uint32_t node = 0;
  std::uint64_t region = 0;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  bool operator==(const bulk_descriptor&) const = default;
};

void write_descriptor(wire::BulkDescriptor::Builder b, const bulk_descriptor& d);
// Rejects what no exporter could have written (zero length, offset + length overflowing).
result<bulk_descriptor> read_descriptor(wire::BulkDescriptor::Reader r);

// How a pull moves the bytes. rendezvous: the exporter answers with an active message whose
// payload UCX moves by rendezvous straight into the puller's buffer (fast where RMA is
// emulated, i.e. TCP). rma: the exporter answers with its address and rkey and the puller
// reads with ucp_get_nbx (native on shared memory and InfiniBand). automatic: chosen per
// peer from the transports UCX selected for the endpoint's RMA lanes.
enum class bulk_path { automatic, rendezvous, rma };

namespace detail {
struct region_record;
struct link_state;
}  // namespace detail

// An exported region. Owned by the exporter; dropping it withdraws the region (pulls that
// arrive later get an error). The memory must stay valid while the region lives and until
// in_flight() is 0 (pulls being served read it).
class bulk_region {
 public:
  bulk_region() = default;
  bulk_region(std::shared_ptr<detail::region_record> record,
              std::weak_ptr<detail::link_state> link);
  ~bulk_region();
  bulk_region(bulk_region&&) noexcept;
  bulk_region& operator=(bulk_region&&) noexcept;
  bulk_region(const bulk_region&) = delete;
  bulk_region& operator=(const bulk_region&) = delete;

  // The region's memory (for regions the link allocated, write the tensor here).
  std::span<std::byte> memory() const;
  // A descriptor for bytes [offset, offset + length) of the region; throws if out of range.
  bulk_descriptor describe(std::uint64_t offset, std::uint64_t length) const;
  bulk_descriptor describe_all() const { return describe(0, memory().size()); }
  std::uint64_t id() const;
  std::uint64_t in_flight() const;

 private:
  void reset();
  std::shared_ptr<detail::region_record> record_;
  std::weak_ptr<detail::link_state> link_;
};

}  // namespace moevement::transport
