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

# Memory a process shares with the processes on its own host (transport/shared_memory.hpp):
# they map it instead of copying it. Whoever opens one checks that the file it finds is the
# one named (device and inode) and that the range lies inside it.
struct ShareHandle {
  pid @0 :Int32;      # the process holding the file open
  fd @1 :Int32;       # its descriptor there
  device @2 :UInt64;  # st_dev and st_ino of the file
  inode @3 :UInt64;
  size @4 :UInt64;    # the whole file
  offset @5 :UInt64;  # the range meant, inside it
  length @6 :UInt64;
  host @7 :UInt64;    # the owner's host (host_tag): another host's handle is never opened
}
