#include "base/hash.hpp"

#include <fmt/format.h>
#include <xxhash.h>

#include <stdexcept>

namespace moevement {

struct hasher::state {
  XXH64_state_t* s = XXH64_createState();
  ~state() { XXH64_freeState(s); }
};

hasher::hasher(std::uint64_t seed) : state_(std::make_unique<state>()) {
  if (state_->s == nullptr) throw std::bad_alloc();
  XXH64_reset(state_->s, seed);
}
hasher::~hasher() = default;
hasher::hasher(hasher&&) noexcept = default;
hasher& hasher::operator=(hasher&&) noexcept = default;

void hasher::update(std::span<const std::byte> bytes) {
  XXH64_update(state_->s, bytes.data(), bytes.size());
}

std::uint64_t hasher::digest() const {
  return XXH64_digest(state_->s);
}

std::uint64_t xxhash64(std::span<const std::byte> bytes, std::uint64_t seed) {
  return XXH64(bytes.data(), bytes.size(), seed);
}

std::string hex16(std::uint64_t v) {
  return fmt::format("{:016x}", v);
}

}  // namespace moevement
