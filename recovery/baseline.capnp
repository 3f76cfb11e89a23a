@0xb1c35a7e0f2d4c91;
# The protocol of the baseline policies' actors (recovery/baseline_policy.hpp): a stage's
# checkpoint agent ships each dense-memory or pec checkpoint to r checkpoint holders on other
# workers (they pull it and keep it in host memory), and a replacement pulls its stage's
# checkpoints back from them for a global rollback. Every message is untrusted: sizes are
# checked against limits, descriptors against the exporter's node.

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("moevement::recovery::wire");

using Envelope = import "/transport/envelope.capnp";
using Bulk = import "/transport/bulk.capnp";

# Agent -> holder: pull this checkpoint of (stage, replica) at state iteration `iteration`
# and keep it; drop every other checkpoint of (stage, replica) whose iteration is not in
# `keep` (what the stage itself still holds). The bytes are a snapshot (snapshotBytes long)
# followed by the policy's trailer (pec: when each operator was saved, tokens since).
struct StoreCheckpoint {
  stage @0 :Int32;
  replica @1 :Int32;
  iteration @2 :Int64;
  tensor @3 :Bulk.BulkDescriptor;
  snapshotBytes @4 :UInt64;
  keep @5 :List(Int64);
}
# Replacement -> holder: every checkpoint of (stage, replica) held here.
struct FetchCheckpoints {
  stage @0 :Int32;
  replica @1 :Int32;
}
struct HeldCheckpoint {
  iteration @0 :Int64;
  tensor @1 :Bulk.BulkDescriptor;
  snapshotBytes @2 :UInt64;
}
struct CheckpointList {
  entries @0 :List(HeldCheckpoint);
}
