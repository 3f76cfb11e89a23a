@0xc8a4e2b19f3d7a61;
# Messages between the two processes of `moevement bench transport`.

using Cxx = import "/capnp/c++.capnp";
using Bulk = import "../transport/bulk.capnp";
$Cxx.namespace("moevement::wire::bench");

struct BenchMessage {
  kind @0 :UInt8;      # see transport_bench.cpp
  value @1 :UInt64;    # 8 bytes of payload: a sequence number or a size
  descriptor @2 :Bulk.BulkDescriptor;
}
