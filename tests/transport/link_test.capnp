@0xe1d2c3b4a5968778;
# Messages the multi-process link tests exchange (test-only schema).

using Cxx = import "/capnp/c++.capnp";
using Bulk = import "../../transport/bulk.capnp";
$Cxx.namespace("moevement::wire::test");

struct TestMessage {
  kind @0 :Text;                      # "ready", "echo", "region", "report", ...
  seq @1 :UInt64;
  blob @2 :Data;
  descriptor @3 :Bulk.BulkDescriptor;
  checksum @4 :UInt64;                # xxhash64 of the bytes the descriptor names
  counts @5 :List(UInt64);            # results a helper reports back
}
