@0x8d486e34d20320c7;
# The actor system's own protocol between nodes. These messages are addressed to actor 0 of a
# node (its system), except Down/Exit which the system turns into mailbox notifications.

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("moevement::actors::proto");

using Envelope = import "/transport/envelope.capnp";
using Address = Envelope.ActorAddress;

# Why an actor stopped. kind follows actors::exit_kind.
struct ExitReason {
  kind @0 :UInt8;
  detail @1 :Text;
}

# The reply to any ask that failed on the remote side (dead target, unknown type, malformed
# message, full mailbox, handler crash). The caller's ask returns it as an error.
struct ErrorReply {
  message @0 :Text;
}

struct Ack {}

# Membership through the head: a node joins, the head answers with every member.
struct Member {
  node @0 :UInt32;
  incarnation @1 :UInt32;
}
struct Join {
  incarnation @0 :UInt32;
}
struct Welcome {
  members @0 :List(Member);
  standby @1 :UInt32;     # the node that takes over as head when the head is lost
  hasStandby @2 :Bool;
}
struct MemberUp {
  member @0 :Member;
}
struct Heartbeat {
  incarnation @0 :UInt32;
}
# Only the head declares a member lost (actors/suspicions.hpp). A member that has not heard
# another one for the heartbeat timeout tells the head (Unreachable), and again once it hears
# it (Reachable); the head's verdict goes to every member (MemberLost), the lost one included.
struct Unreachable {
  member @0 :Member;
  detail @1 :Text;
}
struct Reachable {
  member @0 :Member;
}
struct MemberLost {
  member @0 :Member;
  detail @1 :Text;
  goodbye @2 :Bool;  # it left cleanly
}

# Remote spawn by registered type name.
struct Spawn {
  typeName @0 :Text;
  mailboxCapacity @1 :UInt32;  # 0 = the node's default
}
struct Spawned {
  actor @0 :Address;
}

# Stop an actor on the receiving node; answered with Ack once it is stopped.
struct Stop {
  target @0 :Address;
  reason @1 :ExitReason;
}

# Monitors and links across nodes. Watch registers `watcher` at `target`'s node; when target
# stops, that node sends Down (monitor) or Exit (link) to the watcher's node.
struct Watch {
  watcher @0 :Address;
  target @1 :Address;
  isLink @2 :Bool;
}
struct Down {
  watcher @0 :Address;
  target @1 :Address;
  reason @2 :ExitReason;
  isLink @3 :Bool;
}

# Cluster-wide registry, held by the head.
struct Register {
  name @0 :Text;
  actor @1 :Address;
}
struct Unregister {
  name @0 :Text;
  actor @1 :Address;
}
struct Lookup {
  name @0 :Text;
}
struct Found {
  actor @0 :Address;  # actor 0 = not registered
}

# Supervisors (actors/supervisor.hpp). Children named by registered type, so that a
# supervisor can be told over the wire to grow its set.
struct ChildSpec {
  id @0 :Text;
  node @1 :UInt32;
  typeName @2 :Text;
  restart @3 :UInt8;  # actors::restart_type
}
struct GrowChildren {
  children @0 :List(ChildSpec);
}
struct ListChildren {}
struct Child {
  id @0 :Text;
  actor @1 :Address;  # actor 0 = not running
}
struct ChildList {
  children @0 :List(Child);
}
