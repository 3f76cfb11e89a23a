#include "recovery/slot_pool.hpp"

#include <algorithm>
#include <set>

namespace moevement::recovery {

std::optional<slot_memory> slot_pool::take(std::size_t bytes) {
  std::span<std::byte> memory;
  {
    std::lock_guard lock(mu_);
    entry* best = nullptr;
    for (auto& [base, e] : regions_) {
      const std::size_t size = e.region.memory().size();
      if (!e.lent && size >= bytes && (!best || size < best->region.memory().size())) best = &e;
    }
    if (best == nullptr) {
      missed_.push_back(bytes);
      return std::nullopt;
    }
    best->lent = true;
    memory = best->region.memory();
  }
  // The owner gives the region back (no link call: that thread may not be the actor's). Made
  // outside the lock: if it cannot be made, the deleter gives the region back at once.
  std::shared_ptr<void> owner(static_cast<void*>(memory.data()),
                              [this](void* base) { give_back(static_cast<std::byte*>(base)); });
  return slot_memory{memory, std::move(owner), true};
}

void slot_pool::give_back(const std::byte* base) {
  std::lock_guard lock(mu_);
  if (const auto it = regions_.find(base); it != regions_.end()) it->second.lent = false;
}

void slot_pool::adopt(transport::bulk_region region) {
  if (region.memory().empty()) return;
  std::lock_guard lock(mu_);
  add_free(region);
}

void slot_pool::grow(std::size_t extra) {
  std::set<std::size_t> sizes;
  {
    std::lock_guard lock(mu_);
    for (const auto& [base, e] : regions_) sizes.insert(e.region.memory().size());
  }
  auto fresh = allocate(sizes, extra);
  std::lock_guard lock(mu_);
  for (auto& r : fresh) add_free(r);
}

std::vector<transport::bulk_region> slot_pool::allocate(const std::set<std::size_t>& sizes,
                                                        std::size_t each) {
  // Allocating maps memory (no page is touched yet): outside the lock, so take() never waits.
  std::vector<transport::bulk_region> fresh;
  try {
    for (const std::size_t n : sizes) {
      for (std::size_t i = 0; i < each; ++i) fresh.push_back(io_.allocate(n));
    }
  } catch (const std::exception&) {
    // Out of mappable memory (shm or memlock limits): the captures that miss use the heap,
    // which replicas still read (by rendezvous); the next miss tries again.
    std::lock_guard lock(mu_);
    ++failed_;
  }
  return fresh;
}

void slot_pool::add_free(transport::bulk_region& region) {
  const std::byte* base = region.memory().data();
  regions_.emplace(base, entry{std::move(region), false});
}

void slot_pool::refill(std::size_t keep_free, std::size_t batch) {
  std::set<std::size_t> missed;  // sizes: however many misses, `batch` regions each
  {
    std::lock_guard lock(mu_);
    missed.insert(missed_.begin(), missed_.end());
    missed_.clear();
  }
  auto fresh = allocate(missed, std::max<std::size_t>(batch, 1));
  std::vector<transport::bulk_region> surplus;
  {
    std::lock_guard lock(mu_);
    // Surplus first: the fresh regions are for captures still to come.
    std::vector<std::pair<std::size_t, const std::byte*>> free;
    for (const auto& [base, e] : regions_) {
      if (!e.lent) free.emplace_back(e.region.memory().size(), base);
    }
    if (free.size() > keep_free) {
      std::sort(free.begin(), free.end());
      for (std::size_t i = 0; i + keep_free < free.size(); ++i) {
        const auto it = regions_.find(free[i].second);
        surplus.push_back(std::move(it->second.region));
        regions_.erase(it);
      }
    }
    for (auto& r : fresh) add_free(r);
  }
  // surplus is withdrawn here, on the actor thread
}

const transport::bulk_region* slot_pool::lent_region(const std::byte* base) const {
  std::lock_guard lock(mu_);
  const auto it = regions_.find(base);
  return it != regions_.end() && it->second.lent ? &it->second.region : nullptr;
}

std::size_t slot_pool::free_bytes() const {
  std::lock_guard lock(mu_);
  std::size_t n = 0;
  for (const auto& [base, e] : regions_) n += e.lent ? 0 : e.region.memory().size();
  return n;
}

std::uint64_t slot_pool::failed_refills() const {
  std::lock_guard lock(mu_);
  return failed_;
}

std::size_t slot_pool::regions() const {
  std::lock_guard lock(mu_);
  return regions_.size();
}

}  // namespace moevement::recovery
