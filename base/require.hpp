// Argument checks at API boundaries: throws std::invalid_argument(what) unless ok.
#pragma once

#include <stdexcept>
#include <string>

namespace moevement {

inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

}  // namespace moevement
