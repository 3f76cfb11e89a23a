@0x81d02f8314b3874d;
# The job's config as the launcher read it (TOML + --set), sent to every worker, which
# resolves and validates it again (untrusted: see read_config).

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("moevement::engine::wire");

struct ConfigEntry {
  key @0 :Text;
  value :union {
    boolean @1 :Bool;
    integer @2 :Int64;
    real @3 :Float64;
    text @4 :Text;
  }
}
struct JobConfig {
  entries @0 :List(ConfigEntry);
}
