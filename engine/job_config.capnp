@0xc95797ed0dcfb1fd;
# The job configuration as the head sends it to every worker: the flat key -> value map read
# from TOML and --set, before resolution (each worker resolves it again; engine/job_config.hpp).

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("moevement::engine::wire");

struct ConfigEntry {
  key @0 :Text;  # dotted, e.g. "parallel.pp"
  value :union {
    boolean @1 :Bool;
    integer @2 :Int64;
    real @3 :Float64;
    text @4 :Text;
  }
}

struct JobConfig {
  entries @0 :List(ConfigEntry);  # sorted by key, no duplicates
}
