// Identity of an actor: node, incarnation of that node, actor id. A ref names all three,
// so a message to a dead incarnation can fail fast instead of reaching a replacement.
#pragma once

#include <cstdint>
#include <string>

#include "transport/envelope.hpp"

namespace moevement::actors {

struct actor_ref {
  std::uint32_t node = 0;
  std::uint32_t incarnation = 0;
  std::uint64_t actor = 0;

  bool operator==(const actor_ref&) const = default;
  bool valid() const { return actor != 0; }
  // Same node and actor slot, possibly another incarnation.
  bool same_slot(const actor_ref& o) const { return node == o.node && actor == o.actor; }

  transport::actor_address address() const { return {node, incarnation, actor}; }
  static actor_ref from(const transport::actor_address& a) {
    return {a.node, a.incarnation, a.actor};
  }
  // "node.incarnation/actor", e.g. "3.1/42".
  std::string to_string() const;
};

// An actor_ref in and out of the wire's ActorAddress (messages that name actors).
void write_ref(::moevement::wire::ActorAddress::Builder b, const actor_ref& r);
actor_ref read_ref(::moevement::wire::ActorAddress::Reader r);

}  // namespace moevement::actors
