@0xc24f6611d02c9b5a;
# The residual-MLP stage actor's own message (residual_mlp_actor.hpp), beside the engine's
# protocol: the head asks each stage for statistics of its weights while the job trains.

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("custom_stage::wire");

struct StatsQuery {}

struct Stats {
  stage @0 :Int32;
  replica @1 :Int32;
  iteration @2 :Int64;     # the stage's current (or last) iteration
  parameters @3 :UInt64;   # its operators' parameters
  weightRms @4 :Float64;   # root mean square of their fp32 master weights
}
