// Streaming xxhash64: state_hash and checksums of checkpoint files are built on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace moevement {

class hasher {
 public:
  explicit hasher(std::uint64_t seed = 0);
  ~hasher();
  hasher(const hasher&) = delete;
  hasher& operator=(const hasher&) = delete;
  hasher(hasher&&) noexcept;
  hasher& operator=(hasher&&) noexcept;

  void update(std::span<const std::byte> bytes);
  template <class T>
  void update_value(const T& v) {
    update(std::as_bytes(std::span<const T>(&v, 1)));
  }
  std::uint64_t digest() const;

 private:
  struct state;
  std::unique_ptr<state> state_;
};

std::uint64_t xxhash64(std::span<const std::byte> bytes, std::uint64_t seed = 0);

// 16 lower-case hex digits, the form `state_hash=` is printed in.
std::string hex16(std::uint64_t v);

}  // namespace moevement
