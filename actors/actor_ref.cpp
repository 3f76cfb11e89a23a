#include "actors/actor_ref.hpp"

#include <fmt/format.h>

namespace moevement::actors {

std::string actor_ref::to_string() const {
  return fmt::format("{}.{}/{}", node, incarnation, actor);
}

void write_ref(::moevement::wire::ActorAddress::Builder b, const actor_ref& r) {
  b.setNode(r.node);
  b.setIncarnation(r.incarnation);
  b.setActor(r.actor);
}

actor_ref read_ref(::moevement::wire::ActorAddress::Reader r) {
  return {r.getNode(), r.getIncarnation(), r.getActor()};
}

}  // namespace moevement::actors
