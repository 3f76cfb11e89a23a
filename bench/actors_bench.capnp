@0xd0c3f5a8e7b21946;
# Messages of bench/actors_bench.cpp.

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("moevement::bench");

struct Num {
  value @0 :Int64;
}
struct Note {
  value @0 :Int64;
}
struct Run {
  count @0 :UInt64;
}
struct Ran {
  count @0 :UInt64;
}
