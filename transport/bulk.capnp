@0xd3c1f0a7b2e48c15;
# Bulk regions: a message carries descriptors, never tensor bytes. The receiver pulls the
# bytes into its own buffer from the node that exported the region; that node checks every
# pull against its own region table, so a descriptor from the wire can name nothing else.

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("moevement::wire");

struct BulkDescriptor {
  node @0 :UInt32;    # the exporting node
  region @1 :UInt64;  # region id on that node; ids are never reused
  offset @2 :UInt64;  # bytes from the start of the region
  length @3 :UInt64;  # bytes to pull
}
