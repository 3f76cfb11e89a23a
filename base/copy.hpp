// Copies of large buffers that the copying core does not need afterwards (a snapshot slot).
#pragma once

#include <cstddef>
#include <span>

namespace moevement {

// Copies from into to (same size) with non-temporal stores: the destination's cache lines are
// neither read first (a plain copy reads each line it writes) nor kept, so the copy moves a
// third fewer bytes through memory and leaves the caches to the stages' compute (110 MB with
// XXH3 of each piece: 9.8 ms against 14.3 ms, docs/benchmarks.md). Visible to other threads
// once it returns (it ends with a store fence). The plain std::memcpy is its reference.
void copy_streaming(std::span<std::byte> to, std::span<const std::byte> from);

}  // namespace moevement
