#include "recovery/slot_pool.hpp"

#include <algorithm>
#include <set>

namespace moevement::recovery {

std::optional<slot_memory> slot_pool::take(std::size_t bytes) {
  std::span<std::byte> memory;
  bool fresh = true;
  {
    std::lock_guard lock(mu_);
    entry* best = nullptr;
    for (auto& [base, e] : regions_) {
      const std::size_t size = e.memory().size();
      if (!e.lent && size >= bytes && (!best || size < best->memory().size())) best = &e;
    }
    if (best != nullptr) {
      best->lent = true;
      best->spared = 0;  // used: an ordinary region from now on
      fresh = !best->used;
      best->used = true;
      memory = best->memory();
    } else if (!share_) {
      missed_.push_back(bytes);
      return std::nullopt;
    }
  }
  if (memory.empty()) {
    // A memory file, made here (no link call); exported on the actor thread when described.
    entry e;
    try {
      e.shared = transport::shared_memory::create(bytes);
    } catch (const std::exception&) {
      std::lock_guard lock(mu_);
      ++failed_;
      return std::nullopt;  // the heap, then
    }
    e.lent = true;
    e.used = true;
    memory = e.memory();
    std::lock_guard lock(mu_);
    regions_.emplace(memory.data(), std::move(e));
  }
  // The owner gives the region back (no link call: that thread may not be the actor's). Made
  // outside the lock: if it cannot be made, the deleter gives the region back at once.
  std::shared_ptr<void> owner(static_cast<void*>(memory.data()),
                              [this](void* base) { give_back(static_cast<std::byte*>(base)); });
  return slot_memory{memory, std::move(owner), true, fresh};
}

std::vector<transport::shared_memory> slot_pool::release_files() {
  std::map<const std::byte*, entry> all;
  {
    std::lock_guard lock(mu_);
    all.swap(regions_);
  }
  std::vector<transport::shared_memory> files;
  for (auto& [base, e] : all) {
    e.region = {};  // unexported (or, the link's own, freed) here, on the actor thread
    if (!e.shared.empty()) files.push_back(std::move(e.shared));
  }
  return files;
}

void slot_pool::give_back(const std::byte* base) {
  std::lock_guard lock(mu_);
  if (const auto it = regions_.find(base); it != regions_.end()) it->second.lent = false;
}

void slot_pool::adopt(transport::bulk_region region) {
  if (region.memory().empty()) return;
  std::lock_guard lock(mu_);
  add_free(entry{{}, std::move(region), false, 0, true});  // a restore wrote it
}

void slot_pool::adopt(transport::shared_memory file, std::size_t refills) {
  if (file.empty()) return;
  entry e;
  e.shared = std::move(file);
  e.spared = refills;
  e.used = true;  // a restore wrote it
  std::lock_guard lock(mu_);
  add_free(std::move(e));
}

void slot_pool::grow(std::size_t extra) {
  if (share_) return;
  std::set<std::size_t> sizes;
  {
    std::lock_guard lock(mu_);
    for (const auto& [base, e] : regions_) sizes.insert(e.memory().size());
  }
  auto fresh = allocate(sizes, extra);
  std::lock_guard lock(mu_);
  for (auto& e : fresh) add_free(std::move(e));
}

std::vector<slot_pool::entry> slot_pool::allocate(const std::set<std::size_t>& sizes,
                                                  std::size_t each) {
  // Allocating maps memory (no page is touched yet): outside the lock, so take() never waits.
  std::vector<entry> fresh;
  try {
    for (const std::size_t n : sizes) {
      for (std::size_t i = 0; i < each; ++i) fresh.push_back(entry{{}, io_.allocate(n), false, 0});
    }
  } catch (const std::exception&) {
    // Out of mappable memory (shm or memlock limits): the captures that miss use the heap,
    // which replicas still read (by rendezvous); the next miss tries again.
    std::lock_guard lock(mu_);
    ++failed_;
  }
  return fresh;
}

void slot_pool::add_free(entry e) {
  const std::byte* base = e.memory().data();
  e.lent = false;
  regions_.emplace(base, std::move(e));
}

void slot_pool::refill(std::size_t keep_free, std::size_t batch) {
  if (share_) keep_free = 0;
  std::set<std::size_t> missed;  // sizes: however many misses, `batch` regions each
  {
    std::lock_guard lock(mu_);
    missed.insert(missed_.begin(), missed_.end());
    missed_.clear();
  }
  auto fresh = allocate(missed, std::max<std::size_t>(batch, 1));
  std::vector<entry> surplus;
  {
    std::lock_guard lock(mu_);
    // Surplus first: the fresh regions are for captures still to come.
    std::vector<std::pair<std::size_t, const std::byte*>> free;
    for (auto& [base, e] : regions_) {
      if (e.lent) continue;
      if (e.spared > 0) {
        --e.spared;  // adopted and not taken yet: kept through this refill
        continue;
      }
      free.emplace_back(e.memory().size(), base);
    }
    if (free.size() > keep_free) {
      std::sort(free.begin(), free.end());
      for (std::size_t i = 0; i + keep_free < free.size(); ++i) {
        const auto it = regions_.find(free[i].second);
        surplus.push_back(std::move(it->second));
        regions_.erase(it);
      }
    }
    for (auto& e : fresh) add_free(std::move(e));
  }
  // surplus is withdrawn here, on the actor thread
}

const transport::bulk_region* slot_pool::lent_region(const std::byte* base) {
  std::lock_guard lock(mu_);
  const auto it = regions_.find(base);
  if (it == regions_.end() || !it->second.lent) return nullptr;
  entry& e = it->second;
  if (e.region.memory().empty()) {
    try {
      e.region = io_.export_memory(e.shared.memory());
    } catch (const std::exception&) {
      return nullptr;  // the caller exports the bytes itself, or fails saying why
    }
  }
  return &e.region;
}

std::optional<transport::share_handle> slot_pool::lent_share(const std::byte* base,
                                                             std::uint64_t length) const {
  std::lock_guard lock(mu_);
  const auto it = regions_.find(base);
  if (it == regions_.end() || !it->second.lent || it->second.shared.empty()) return std::nullopt;
  return it->second.shared.share(0, length);
}

std::size_t slot_pool::free_bytes() const {
  std::lock_guard lock(mu_);
  std::size_t n = 0;
  for (const auto& [base, e] : regions_) n += e.lent ? 0 : e.memory().size();
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
