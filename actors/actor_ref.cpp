#include "actors/actor_ref.hpp"

#include <fmt/format.h>

namespace moevement::actors {

std::string actor_ref::to_string() const {
  return fmt::format("{}.{}/{}", node, incarnation, actor);
}

}  // namespace moevement::actors
