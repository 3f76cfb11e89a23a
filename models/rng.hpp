// Counter-based randomness: a value is a pure function of (key, counter), so replay and
// resume need no RNG state. Keys are built by mixing the seed with what the value is for
// (operator index, parameter index, iteration, replica, micro-batch, row).
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace moevement::models {

// SplitMix64's finalizer: a bijective 64-bit mixer with full avalanche.
constexpr std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A key for a purpose: mix64 folded over the parts in order.
constexpr std::uint64_t make_key(std::initializer_list<std::uint64_t> parts) {
  std::uint64_t k = 0x6d6f6576656d656eull;  // "moevemen"
  for (const auto p : parts) k = mix64(k ^ p);
  return k;
}

constexpr std::uint64_t random_bits(std::uint64_t key, std::uint64_t counter) {
  return mix64(key ^ mix64(counter));
}

// Uniform in [0, 1) with 53 random bits.
inline double random_uniform(std::uint64_t key, std::uint64_t counter) {
  return static_cast<double>(random_bits(key, counter) >> 11) * 0x1.0p-53;
}

// Standard normal by Box-Muller from counters 2c and 2c+1 (libm is fixed per machine kind).
inline double random_normal(std::uint64_t key, std::uint64_t counter) {
  const double u1 = 1.0 - random_uniform(key, 2 * counter);  // (0, 1]
  const double u2 = random_uniform(key, 2 * counter + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace moevement::models
