@0xbe0a935e2752c97f;
# The wire envelope: every actor message travels in one. Tensors never travel inline;
# payloads carry descriptors (see bulk regions) and the receiver pulls the bytes.

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("moevement::wire");

struct ActorAddress {
  node @0 :UInt32;         # node_id: one worker process
  incarnation @1 :UInt32;  # bumped on every restart of the node; stale ones fail fast
  actor @2 :UInt64;        # actor_id within the node
}

struct Envelope {
  sender @0 :ActorAddress;
  receiver @1 :ActorAddress;
  typeId @2 :UInt64;         # Cap'n Proto type id of the payload struct
  correlationId @3 :UInt64;  # 0 for tell; ask and its reply share one
  budgetNs @4 :UInt64;       # time left to the sender's deadline when sent, 0 = none;
                             # relative, so hosts need not agree on clocks
  payload @5 :AnyPointer;
}
