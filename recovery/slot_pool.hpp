// Link-allocated memory for a stage's captured slots (distributed `moevement` policy).
//
// Replicas read a slot with one RMA get when it lies in memory the link allocated (on one
// host: the shared-memory transports map it), and by a rendezvous through the TCP loopback
// when it is ordinary heap memory (docs/transport.md). The capture runs on its own thread, but
// the link may only be used from the actor thread. So the pool splits the work:
// - the capture thread take()s a free region (or misses, and the size is remembered);
// - the actor thread refill()s: it allocates the regions missed and frees surplus free ones.
// A lent region comes back to the pool when the capture drops the memory's owner; regions are
// only ever created and destroyed on the actor thread. The pool must outlive every owner it
// handed out (capture_shared declares it before the capture).
//
// With `share` (checkpoint.share_memory), the regions are memory files a replica on this host
// maps instead of copying (transport/shared_memory.hpp), exported to the link as well for the
// replicas that must pull (on other hosts, or where mapping fails). Making one needs no link,
// so take() never misses: the capture thread makes what it lacks, and the actor thread
// exports it when it first describes it (lent_region).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

#include "engine/bulk_io.hpp"
#include "recovery/sparse_capture.hpp"
#include "transport/shared_memory.hpp"

namespace moevement::recovery {

class slot_pool {
 public:
  explicit slot_pool(engine::bulk_io& io, bool share = false) : io_(io), share_(share) {}
  slot_pool(const slot_pool&) = delete;
  slot_pool& operator=(const slot_pool&) = delete;

  // Any thread: the smallest free region of at least `bytes`, lent until the returned owner is
  // dropped; nullopt when none is free (the next refill() allocates one of `bytes`).
  std::optional<slot_memory> take(std::size_t bytes);
  // Actor thread: frees free regions beyond `keep_free` (the largest are kept), then allocates
  // `batch` regions of each size take() missed, however often it was missed (one window's
  // miss stands for the next windows' too: they would otherwise start on the heap, one more
  // each time; and a burst of misses must not allocate without bound). A shared pool never
  // misses and keeps nothing free: it makes what the capture asks for, so the memory a
  // recovery's extra windows took goes back to the fault-free level.
  void refill(std::size_t keep_free, std::size_t batch = 1);
  // Actor thread: a region allocated elsewhere becomes a free one of the pool (a replacement's
  // restore pulled its window into such regions: their pages are already touched). A memory
  // file is kept free through `refills` refills before it counts as surplus: a shared pool
  // keeps nothing free, and the replacement's first window takes its restored files one slot,
  // and one refill, at a time.
  void adopt(transport::bulk_region region);
  void adopt(transport::shared_memory file, std::size_t refills = 0);  // (exported when lent)
  // Actor thread: `extra` more regions of every size the pool has (allocated, not touched):
  // after a recovery, for the windows that would otherwise start on the heap (a replacement's
  // next windows; a survivor's, while its abandoned windows keep their regions). A shared
  // pool needs none (it never misses).
  void grow(std::size_t extra);
  // Actor thread: the lent region whose memory starts at `base`, or nullptr (heap memory).
  const transport::bulk_region* lent_region(const std::byte* base);
  // Any thread: a handle to the first `length` bytes of the lent region at `base`, for a
  // process of this host; nullopt for heap memory and regions that are not memory files.
  std::optional<transport::share_handle> lent_share(const std::byte* base,
                                                    std::uint64_t length) const;

  // Actor thread, once nothing captures into the pool any more (its capture is being dropped):
  // unexports every region, frees the link's own, and hands over the memory files, whose
  // unmapping (most of a stage's snapshot memory) may then happen on any thread.
  std::vector<transport::shared_memory> release_files();

  std::size_t free_bytes() const;
  std::size_t regions() const;
  // Refills that could not allocate every region (those captures stay on the heap).
  std::uint64_t failed_refills() const;

 private:
  struct entry {
    transport::shared_memory shared;  // empty: the link allocated the region
    transport::bulk_region region;    // (declared after: unexported before the unmap)
    bool lent = false;
    std::size_t spared = 0;  // refills it stays while free (adopt)
    bool used = false;       // lent before (or adopted): its pages were written
    std::span<std::byte> memory() const {
      return shared.empty() ? region.memory() : shared.memory();
    }
  };
  void give_back(const std::byte* base);
  // Actor thread, without the lock: `each` new link-allocated regions of every size (failures
  // counted; a shared pool makes its memory files in take()).
  std::vector<entry> allocate(const std::set<std::size_t>& sizes, std::size_t each);
  void add_free(entry e);  // under the lock

  engine::bulk_io& io_;
  bool share_ = false;
  mutable std::mutex mu_;
  std::map<const std::byte*, entry> regions_;  // by the region's base address
  std::vector<std::size_t> missed_;
  std::uint64_t failed_ = 0;
};

}  // namespace moevement::recovery
