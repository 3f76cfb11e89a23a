@0xe4589f2141e8da53;
# Messages of the actor tests.

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("moevement::actors::test");

struct Ping {
  seq @0 :UInt64;
}
struct Add {
  a @0 :Int64;
  b @1 :Int64;
}
struct Sum {
  value @0 :Int64;
}
struct Sleep {
  ms @0 :UInt32;
  tag @1 :UInt64;
}
struct Done {
  tag @0 :UInt64;
}
struct Crash {
  why @0 :Text;
}
struct Get {}
struct Count {
  n @0 :UInt64;
  log @1 :List(UInt64);
}
struct Relay {
  to @0 :UInt64;  # actor id on the same node
  a @1 :Int64;
}
