#include "launcher/inject.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>

#include "models/model.hpp"

namespace moevement::launcher {

namespace {

constexpr const char* inject_usage =
    "expected kill|hang:stage=S,replica=D,iter=T[,phase=forward|backward|step|snapshot], "
    "kill|hang:stage=S,replica=D,during=recovery[,nth=K][,delay_ms=M], "
    "kill|hang:stage=S,replica=D,during=start[,delay_ms=M] (each with "
    "[,scope=host]), stall:stage=S,replica=D,iter=T,phase=P, "
    "mtbf:SECONDS[,seed=N][,max=K], trace:FILE or "
    "flip:stage=S,replica=D,iter=T[,operator=NAME][,word=I][,bit=K][,target=weight], "
    "flip:stage=S,replica=D,iter=T,target=slot[,bit=K], "
    "flip:stage=S,replica=D,iter=T,target=activation[,word=I][,bit=K] (docs/recovery.md)";
constexpr const char* table_usage =
    "expected kind = \"kill\"|\"hang\" with stage, replica and iter (phase) or "
    "during = \"recovery\" (nth, delay_ms) or \"start\" (delay_ms); kind = \"stall\" with "
    "stage, replica, iter "
    "and phase; kind = \"mtbf\" with seconds (seed, max); "
    "kind = \"trace\" with file; or kind = \"flip\" with stage, replica and iter "
    "(operator, word, bit, target) (docs/configuration.md)";
constexpr const char* trace_usage =
    "expected `<seconds> kill|hang stage=S replica=D` (seconds of training, not decreasing; "
    "# starts a comment)";
constexpr int max_scheduled = 100000;  // failures one schedule may hold

[[noreturn]] void bad(const std::string& where, const std::string& what) {
  throw std::invalid_argument(fmt::format("{}: {}; {}", where, what, inject_usage));
}

std::int64_t integer(const std::string& where, const std::string& key, const std::string& v,
                     std::int64_t lo, std::int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || x < lo || x > hi) {
    bad(where, fmt::format("{} must be an integer in [{}, {}], got '{}'", key, lo, hi, v));
  }
  return x;
}

double real(const std::string& where, const std::string& key, const std::string& v, double lo,
            double hi) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !std::isfinite(x) || x < lo || x > hi) {
    bad(where, fmt::format("{} must be a number in [{}, {}], got '{}'", key, lo, hi, v));
  }
  return x;
}

const char* phase_name(engine::fault_point p) {
  switch (p) {
    case engine::fault_point::forward:
      return "forward";
    case engine::fault_point::backward:
      return "backward";
    case engine::fault_point::step:
      return "step";
    case engine::fault_point::snapshot:
      return "snapshot";
  }
  return "?";
}

// "k=v,k=v" after the head; each key at most once.
std::vector<std::pair<std::string, std::string>> items(const std::string& where,
                                                       const std::string& rest) {
  std::vector<std::pair<std::string, std::string>> out;
  std::set<std::string> seen;
  std::size_t pos = 0;
  while (true) {
    const auto comma = rest.find(',', pos);
    const std::string item =
        rest.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0) bad(where, fmt::format("'{}' is not key=value", item));
    std::string k = item.substr(0, eq);
    if (!seen.insert(k).second) bad(where, fmt::format("{} is given twice", k));
    out.emplace_back(std::move(k), item.substr(eq + 1));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

// splitmix64: a small generator whose sequence is fixed by its definition (std::
// distributions are not the same across standard libraries).
struct splitmix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  double open_unit() { return (double(next() >> 11) + 0.5) * 0x1.0p-53; }  // (0, 1)
  std::uint64_t below(std::uint64_t n) {
    return std::uint64_t((static_cast<unsigned __int128>(next()) * n) >> 64);
  }
};

// The keys every injection names its target by: stage=S, replica=D, iter=T (T >= first_iter).
// False for any other key (the caller's own).
struct target_keys {
  bool stage = false, replica = false, iter = false;
};
bool read_target_key(const std::string& where, const std::string& k, const std::string& v,
                     std::int64_t first_iter, injection& inj, target_keys& seen) {
  if (k == "stage") {
    inj.stage = int(integer(where, k, v, 0, 1 << 16));
    seen.stage = true;
  } else if (k == "replica") {
    inj.replica = int(integer(where, k, v, 0, 1 << 16));
    seen.replica = true;
  } else if (k == "iter") {
    inj.iteration = integer(where, k, v, first_iter, std::int64_t(1) << 40);
    seen.iter = true;
  } else {
    return false;
  }
  return true;
}

// flip:stage=S,replica=D,iter=T[,operator=NAME][,word=I][,bit=K][,target=weight]
void parse_flip(const std::string& where, const std::string& rest, injection& inj) {
  inj.what = injection::kind::flip;
  if (rest.empty()) bad(where, "no keys after ':'");
  target_keys seen;
  for (const auto& [k, v] : items(where, rest)) {
    if (read_target_key(where, k, v, 0, inj, seen)) continue;
    if (k == "operator") {
      if (v.empty() || v.size() > 128)
        bad(where, "operator must name an operator (1 to 128 bytes)");
      inj.op = v;
    } else if (k == "word") {
      inj.word = integer(where, k, v, 0, std::int64_t(1) << 40);
    } else if (k == "bit") {
      inj.bit = int(integer(where, k, v, 0, 31));
    } else if (k == "target") {
      if (v != "weight" && v != "slot" && v != "activation") {
        bad(where, fmt::format("target must be weight (an FP32 master weight), slot (a snapshot "
                               "copy) or activation (a boundary tensor sent), got '{}'",
                               v));
      }
      inj.slot_copy = v == "slot";
      inj.activation = v == "activation";
    } else {
      bad(where, fmt::format("unknown key '{}' for flip (stage, replica, iter, operator, word, "
                             "bit, target)",
                             k));
    }
  }
  if (!seen.stage || !seen.replica || !seen.iter) bad(where, "flip needs stage, replica and iter");
  if (inj.slot_copy && (!inj.op.empty() || inj.word != 0)) {
    bad(where, "operator and word go with target=weight, not target=slot");
  }
  if (inj.activation && !inj.op.empty()) {
    bad(where, "operator goes with target=weight, not target=activation");
  }
}

std::string config_dir_of(const std::string& config_path) {
  return std::filesystem::path(config_path).parent_path().string();
}

}  // namespace

std::string injection::text() const {
  switch (what) {
    case kind::mtbf: {
      std::string s = fmt::format("mtbf:{},seed={}", mtbf_s, seed);
      if (max_failures >= 0) s += fmt::format(",max={}", max_failures);
      return s;
    }
    case kind::trace:
      return "trace:" + file;
    case kind::flip:
      if (activation) {
        return fmt::format("flip:stage={},replica={},iter={},target=activation,word={},bit={}",
                           stage, replica, iteration, word, bit);
      }
      if (slot_copy) {
        return fmt::format("flip:stage={},replica={},iter={},target=slot,bit={}", stage, replica,
                           iteration, bit);
      }
      return fmt::format("flip:stage={},replica={},iter={}{},word={},bit={}", stage, replica,
                         iteration, op.empty() ? "" : ",operator=" + op, word, bit);
    default:
      break;
  }
  const char* name = what == kind::kill ? "kill" : what == kind::hang ? "hang" : "stall";
  std::string s = fmt::format("{}:stage={},replica={}", name, stage, replica);
  if (during_recovery) {
    s += fmt::format(",during=recovery,nth={},delay_ms={}", nth, delay_ms);
  } else if (during_start) {
    s += fmt::format(",during=start,delay_ms={}", delay_ms);
  } else {
    s += fmt::format(",iter={}", iteration);
    if (phase) s += fmt::format(",phase={}", phase_name(*phase));
  }
  if (whole_host) s += ",scope=host";
  return s;
}

std::string scheduled_failure::text() const {
  return fmt::format("{:.3f} s: {} stage={} replica={}", at_s,
                     what == failure_kind::kill ? "kill" : "hang", stage, replica);
}

injection parse_injection(const std::string& spec, const std::string& source) {
  const std::string where = source.empty() ? "--inject " + spec : source;
  injection inj;
  inj.source = where;
  const auto colon = spec.find(':');
  if (colon == std::string::npos) bad(where, "no ':' after the kind of failure");
  const std::string head = spec.substr(0, colon), rest = spec.substr(colon + 1);
  if (head == "trace") {
    if (rest.empty()) bad(where, "trace: needs a file name");
    inj.what = injection::kind::trace;
    inj.file = rest;
    return inj;
  }
  if (head == "mtbf") {
    inj.what = injection::kind::mtbf;
    const auto comma = rest.find(',');
    inj.mtbf_s =
        real(where, "SECONDS (the mean time between failures)", rest.substr(0, comma), 1e-3, 1e9);
    if (comma != std::string::npos) {
      for (const auto& [k, v] : items(where, rest.substr(comma + 1))) {
        if (k == "seed") {
          inj.seed =
              std::uint64_t(integer(where, k, v, 0, std::numeric_limits<std::int64_t>::max()));
        } else if (k == "max") {
          inj.max_failures = int(integer(where, k, v, 1, max_scheduled));
        } else {
          bad(where, fmt::format("unknown key '{}' for mtbf (seed, max)", k));
        }
      }
    }
    return inj;
  }
  if (head == "flip") {
    parse_flip(where, rest, inj);
    return inj;
  }
  if (head == "kill") {
    inj.what = injection::kind::kill;
  } else if (head == "hang") {
    inj.what = injection::kind::hang;
  } else if (head == "stall") {
    inj.what = injection::kind::stall;
  } else {
    bad(where, fmt::format("unknown failure '{}'", head));
  }
  if (rest.empty()) bad(where, "no keys after ':'");
  target_keys seen;
  bool have_nth = false, have_delay = false;
  for (const auto& [k, v] : items(where, rest)) {
    if (read_target_key(where, k, v, 1, inj, seen)) continue;
    if (k == "phase") {
      if (v == "forward") {
        inj.phase = engine::fault_point::forward;
      } else if (v == "backward") {
        inj.phase = engine::fault_point::backward;
      } else if (v == "step") {
        inj.phase = engine::fault_point::step;
      } else if (v == "snapshot") {
        inj.phase = engine::fault_point::snapshot;
      } else {
        bad(where, fmt::format("phase must be forward, backward, step or snapshot, got '{}'", v));
      }
    } else if (k == "scope") {
      if (v != "host" && v != "process") {
        bad(where, fmt::format("scope must be process or host, got '{}'", v));
      }
      inj.whole_host = v == "host";
    } else if (k == "during") {
      if (v != "recovery" && v != "start") {
        bad(where, fmt::format("during must be recovery or start, got '{}'", v));
      }
      inj.during_recovery = v == "recovery";
      inj.during_start = v == "start";
    } else if (k == "nth") {
      inj.nth = int(integer(where, k, v, 1, 1 << 20));
      have_nth = true;
    } else if (k == "delay_ms") {
      inj.delay_ms = integer(where, k, v, 0, 3600 * 1000);
      have_delay = true;
    } else {
      bad(where, fmt::format("unknown key '{}'", k));
    }
  }
  if (!seen.stage || !seen.replica) bad(where, "stage and replica are both needed");
  if (seen.iter == (inj.during_recovery || inj.during_start)) {
    bad(where, "give either iter=T or during=recovery|start (one of them)");
  }
  if (inj.phase && !seen.iter) bad(where, "phase goes with iter=T, not during=...");
  if (inj.what == injection::kind::stall && !inj.phase) {
    bad(where, "stall needs iter=T and phase=P: the worker's own compute thread stalls there");
  }
  if (inj.phase && inj.whole_host) {
    bad(where, "scope=host is the head's: it does not go with phase (a worker's own failure)");
  }
  if (have_nth && !inj.during_recovery) bad(where, "nth goes with during=recovery");
  if (have_delay && !inj.during_recovery && !inj.during_start) {
    bad(where, "delay_ms goes with during=recovery or during=start");
  }
  return inj;
}

std::vector<std::string> inject_table_keys() {
  return {"kind",    "stage", "replica", "iter", "phase",    "scope", "during", "nth",   "delay_ms",
          "seconds", "seed",  "max",     "file", "operator", "word",  "bit",    "target"};
}

std::vector<injection> take_inject_tables(models::config_map& raw, const std::string& config_path) {
  // index -> key -> value
  std::map<long, std::map<std::string, models::config_value>> tables;
  for (auto it = raw.begin(); it != raw.end();) {
    const std::string& key = it->first;
    if (key != "inject" && !key.starts_with("inject.")) {
      ++it;
      continue;
    }
    const auto dot = key.find('.', 7);
    const std::string index =
        key.size() > 7 ? key.substr(7, dot == std::string::npos ? dot : dot - 7) : "";
    char* end = nullptr;
    const long i = std::strtol(index.c_str(), &end, 10);
    if (key == "inject" || index.empty() || *end != '\0' || i < 0 || i > max_scheduled ||
        dot == std::string::npos || dot + 1 >= key.size() ||
        key.find('.', dot + 1) != std::string::npos) {
      throw std::invalid_argument(fmt::format(
          "{}: {}: failure injections are a list of tables, one per failure: [[inject]] with "
          "keys kind, stage, replica, ... (docs/configuration.md)",
          config_path, key));
    }
    tables[i][key.substr(dot + 1)] = it->second;
    it = raw.erase(it);
  }
  std::vector<injection> out;
  int number = 0;
  for (const auto& [i, t] : tables) {
    ++number;
    // The n-th table of the file (1-based), and the index its flattened keys carry (--set).
    const std::string source =
        fmt::format("[[inject]] table {} of {} (keys inject.{}.*)", number, config_path, i);
    auto fail = [&](const std::string& what) -> void {
      throw std::invalid_argument(fmt::format("{}: {}; {}", source, what, table_usage));
    };
    const auto k = t.find("kind");
    if (k == t.end()) fail("no kind");
    const std::string kind = std::holds_alternative<std::string>(k->second)
                                 ? std::get<std::string>(k->second)
                                 : std::string();
    std::set<std::string> allowed;
    if (kind == "kill" || kind == "hang") {
      allowed = {"kind", "stage", "replica", "iter", "phase", "scope", "during", "nth", "delay_ms"};
    } else if (kind == "stall") {
      allowed = {"kind", "stage", "replica", "iter", "phase"};
    } else if (kind == "mtbf") {
      allowed = {"kind", "seconds", "seed", "max"};
    } else if (kind == "trace") {
      allowed = {"kind", "file"};
    } else if (kind == "flip") {
      allowed = {"kind", "stage", "replica", "iter", "operator", "word", "bit", "target"};
    } else {
      fail(fmt::format(
          "kind must be the string \"kill\", \"hang\", \"stall\", \"mtbf\", \"trace\" or "
          "\"flip\", got {}",
          std::holds_alternative<std::string>(k->second) ? "\"" + kind + "\""
                                                         : models::config_type_name(k->second)));
    }
    auto text_of = [&](const std::string& key, const models::config_value& v) -> std::string {
      const bool string_key = key == "phase" || key == "scope" || key == "during" ||
                              key == "file" || key == "operator" || key == "target";
      if (string_key) {
        if (!std::holds_alternative<std::string>(v)) {
          fail(fmt::format("{} must be a string, got {}", key, models::config_type_name(v)));
        }
        return std::get<std::string>(v);
      }
      if (key == "seconds") {
        if (const auto* d = std::get_if<double>(&v)) return fmt::format("{}", *d);
      }
      if (const auto* n = std::get_if<std::int64_t>(&v)) return std::to_string(*n);
      fail(fmt::format("{} must be {}, got {}", key, key == "seconds" ? "a number" : "an integer",
                       models::config_type_name(v)));
      return {};
    };
    std::string spec = kind + ":", tail;
    for (const auto& [key, v] : t) {
      if (key == "kind") continue;
      if (!allowed.contains(key)) {
        fail(fmt::format("unknown key '{}' for kind = \"{}\"", key, kind));
      }
      if (kind == "mtbf" && key == "seconds") continue;
      if (kind == "trace") continue;
      tail += (tail.empty() ? "" : ",") + key + "=" + text_of(key, v);
    }
    if (kind == "mtbf") {
      const auto s = t.find("seconds");
      if (s == t.end()) fail("kind = \"mtbf\" needs seconds");
      spec += text_of("seconds", s->second) + (tail.empty() ? "" : "," + tail);
    } else if (kind == "trace") {
      const auto f = t.find("file");
      if (f == t.end()) fail("kind = \"trace\" needs file");
      std::filesystem::path p = text_of("file", f->second);
      if (p.empty()) fail("file is empty");
      if (p.is_relative()) p = std::filesystem::path(config_dir_of(config_path)) / p;
      spec += p.string();
    } else {
      spec += tail;
    }
    try {
      out.push_back(parse_injection(spec, source));
    } catch (const std::invalid_argument& e) {
      // The table's form of what to write, not the command line's.
      std::string what = e.what();
      what = what.substr(0, what.find(std::string("; ") + inject_usage));
      throw std::invalid_argument(fmt::format("{}; {}", what, table_usage));
    }
  }
  return out;
}

std::vector<scheduled_failure> read_trace(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    throw std::invalid_argument(
        fmt::format("trace:{}: cannot read the file; {}", path, trace_usage));
  }
  std::vector<scheduled_failure> out;
  std::string line;
  int number = 0;
  double last = 0.0;
  while (std::getline(in, line)) {
    ++number;
    const auto where = fmt::format("trace {} line {}", path, number);
    auto fail = [&](const std::string& what) {
      throw std::invalid_argument(fmt::format("{}: {}; {}", where, what, trace_usage));
    };
    if (const auto hash = line.find('#'); hash != std::string::npos) line.erase(hash);
    std::istringstream words(line);
    std::vector<std::string> w;
    for (std::string x; words >> x;) w.push_back(x);
    if (w.empty()) continue;
    if (w.size() != 4) fail(fmt::format("{} fields, expected 4", w.size()));
    scheduled_failure f;
    f.origin = where;
    char* end = nullptr;
    f.at_s = std::strtod(w[0].c_str(), &end);
    if (*end != '\0' || !std::isfinite(f.at_s) || f.at_s < 0.0 || f.at_s > 1e9) {
      fail(fmt::format("'{}' is not a time in seconds in [0, 1e9]", w[0]));
    }
    if (f.at_s < last) {
      fail(fmt::format("{} s comes before the previous line's {} s (keep the lines in time order)",
                       f.at_s, last));
    }
    last = f.at_s;
    if (w[1] == "kill") {
      f.what = failure_kind::kill;
    } else if (w[1] == "hang") {
      f.what = failure_kind::hang;
    } else {
      fail(fmt::format("unknown failure '{}' (kill or hang)", w[1]));
    }
    bool have_stage = false, have_replica = false;
    for (int k = 2; k < 4; ++k) {
      const auto eq = w[std::size_t(k)].find('=');
      const std::string key = w[std::size_t(k)].substr(0, eq);
      const std::string v = eq == std::string::npos ? "" : w[std::size_t(k)].substr(eq + 1);
      bool* have = key == "stage" ? &have_stage : key == "replica" ? &have_replica : nullptr;
      if (eq == std::string::npos || have == nullptr || *have) {
        fail(fmt::format("'{}' is not stage=S or replica=D (each once)", w[std::size_t(k)]));
      }
      char* e = nullptr;
      const long x = std::strtol(v.c_str(), &e, 10);
      if (v.empty() || *e != '\0' || x < 0 || x > (1 << 16)) {
        fail(fmt::format("{} must be an integer in [0, 65536], got '{}'", key, v));
      }
      (key == "stage" ? f.stage : f.replica) = int(x);
      *have = true;
    }
    if (out.size() >= std::size_t(max_scheduled)) fail("too many failures in one trace");
    out.push_back(std::move(f));
  }
  if (out.empty()) {
    throw std::invalid_argument(
        fmt::format("trace:{}: no failures in the file; {}", path, trace_usage));
  }
  return out;
}

std::vector<scheduled_failure> mtbf_schedule(const injection& inj, int pp, int dp, int spares) {
  const int count = inj.max_failures >= 0 ? inj.max_failures : spares;
  splitmix64 rng{inj.seed};
  std::vector<scheduled_failure> out;
  double t = 0.0;
  for (int i = 0; i < count; ++i) {
    t += -inj.mtbf_s * std::log(rng.open_unit());  // exponential gaps: a Poisson process
    const auto role = rng.below(std::uint64_t(pp) * std::uint64_t(dp));
    scheduled_failure f;
    f.at_s = t;
    f.stage = int(role % std::uint64_t(pp));
    f.replica = int(role / std::uint64_t(pp));
    f.origin = fmt::format("{} failure {}", inj.text(), i + 1);
    out.push_back(std::move(f));
  }
  return out;
}

namespace {

// A flip the job can find: another replica of the stage to compare with, on the host.
void check_flip(const injection& inj, const engine::job_config& job) {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument(fmt::format("{}: {}", inj.source, what));
  };
  if (inj.activation) {  // found at a replay of the stage's group, which a recovery runs
    if (inj.stage + 1 >= job.pp) {
      fail(
          fmt::format("stage {} is the last: it sends no activation (target=activation needs "
                      "a stage before the last)",
                      inj.stage));
    }
    if (job.policy != engine::policy_kind::moevement) {
      fail(
          "target=activation is found when policy moevement replays the stage; "
          "checkpoint.policy is " +
          engine::policy_name(job.policy));
    }
    return;
  }
  if (inj.slot_copy) {  // another copy to use instead
    if (job.policy != engine::policy_kind::moevement) {
      fail("target=slot flips a snapshot copy of policy moevement's; checkpoint.policy is " +
           engine::policy_name(job.policy));
    }
    if (job.share_memory && job.backend == "local") {
      fail(
          "target=slot needs checkpoint.share_memory = false on the local backend: with it, "
          "replicas on the owner's host map the owner's memory (one copy, no other to use)");
    }
    if (job.snapshot_replicas < 2) {
      fail("target=slot needs checkpoint.replicas >= 2 (another copy to use instead)");
    }
    return;
  }
  if (job.dp < 2 && job.shadow_every == 0) {
    fail(
        fmt::format("a flip at parallel.dp = {} would go unseen: silent corruption is found by "
                    "comparing a stage's replicas, so it needs parallel.dp >= 2 (3 to name the "
                    "bad one by majority), or with one copy checkpoint.shadow_every > 0",
                    job.dp));
  }
  if (job.verify_every == 0 && job.shadow_every == 0) {
    fail(
        "checkpoint.verify_every = 0 turns the silent-corruption checks off, so a flip would "
        "go unseen; set it to 1 or more");
  }
  if (job.train.device == models::device::cuda) {
    fail(
        "flip changes a CPU stage's host weights; GPU stages (train.device = \"cuda\") are not "
        "checked for silent corruption yet");
  }
  if (job.stage_type == "moe") {
    // The built-in stage's operators, by name (nothing is allocated): a name it lacks, or a
    // word past its master weights, is refused here, not by the worker once the job runs.
    const models::moe_model model(job.model, 0, 0, 0, false);
    const auto range = models::partition(job.model, job.pp).at(std::size_t(inj.stage));
    // Under expert parallelism the replica holds its EP rank's block of experts only.
    const models::expert_split split =
        job.ep > 1 ? models::expert_split{inj.replica % job.ep, job.ep} : models::expert_split{};
    std::string names;
    for (std::size_t i = range.first_op; i < range.last_op; ++i) {
      const auto& op = model.ops()[i];
      const std::string& name = op.name();
      const auto at = name.rfind(".expert");
      if (at != std::string::npos &&
          !split.holds(std::atoi(name.c_str() + at + 7), job.model.experts)) {
        continue;
      }
      if (inj.op.empty() || name == inj.op) {
        if (inj.word >= op.numel()) {
          fail(fmt::format("operator {} has {} master weights: word must be 0..{}", name,
                           op.numel(), op.numel() - 1));
        }
        // Each expert's copies are the replicas of its EP rank: dp / ep of them. (A shadow check
        // replays replica 0 only.)
        if (at != std::string::npos && job.dp / std::max(job.ep, 1) < 2 &&
            (job.shadow_every == 0 || inj.replica != 0)) {
          fail(fmt::format(
              "a flip in expert operator {} would go unseen: at parallel.dp = {} and "
              "parallel.ep = {} each expert has {} copy, and silent corruption is found by "
              "comparing copies (dp / ep >= 2 needed), or checkpoint.shadow_every > 0",
              name, job.dp, job.ep, job.dp / std::max(job.ep, 1)));
        }
        return;
      }
      if (names.size() < 400) names += (names.empty() ? "" : ", ") + name;
    }
    fail(fmt::format("stage {} replica {} has no operator '{}' (it has {}{})", inj.stage,
                     inj.replica, inj.op, names, names.size() >= 400 ? ", ..." : ""));
  }
}

}  // namespace

std::vector<scheduled_failure> check_injection(const injection& inj,
                                               const engine::job_config& job) {
  const std::string& where = inj.source;
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument(fmt::format("{}: {}", where, what));
  };
  auto check_role = [&](int stage, int replica, const std::string& at) {
    if (stage >= job.pp || replica >= job.dp) {
      fail(
          fmt::format("{}there is no stage {} replica {} (parallel.pp={} parallel.dp={}: stages "
                      "0..{}, replicas 0..{})",
                      at, stage, replica, job.pp, job.dp, job.pp - 1, job.dp - 1));
    }
  };
  switch (inj.what) {
    case injection::kind::mtbf: {
      if (inj.max_failures < 0 && job.spares == 0) {
        fail(
            "cluster.spares is 0 and max defaults to it, so no failure would happen; give "
            "max=K or raise cluster.spares (each recovered failure uses one spare)");
      }
      return mtbf_schedule(inj, job.pp, job.dp, job.spares);
    }
    case injection::kind::trace: {
      std::vector<scheduled_failure> schedule;
      try {
        schedule = read_trace(inj.file);
      } catch (const std::invalid_argument& e) {
        fail(e.what());
      }
      for (const auto& f : schedule) check_role(f.stage, f.replica, f.origin + ": ");
      return schedule;
    }
    default:
      break;
  }
  check_role(inj.stage, inj.replica, "");
  if (inj.what == injection::kind::flip) check_flip(inj, job);
  if (!inj.during_recovery && !inj.during_start && inj.iteration >= job.train.iterations) {
    // (A flip may strike after iteration 0's step; a failure from 1 on.)
    const int first = inj.what == injection::kind::flip ? 0 : 1;
    fail(
        fmt::format("iter={} never runs: the job runs iterations 0..{} (train.iterations = {}); "
                    "use {}..{}",
                    inj.iteration, job.train.iterations - 1, job.train.iterations, first,
                    job.train.iterations - 1));
  }
  if (inj.phase == engine::fault_point::snapshot && job.policy != engine::policy_kind::moevement) {
    fail(
        fmt::format("phase=snapshot needs checkpoint.policy = \"moevement\" (policy {} takes no "
                    "snapshots)",
                    engine::policy_name(job.policy)));
  }
  if (inj.what == injection::kind::stall &&
      engine::recovery_of(job.policy) == engine::recovery_kind::rollback) {
    fail(fmt::format(
        "a stall under policy {} would stall again: the rollback re-runs iteration {} on the "
        "replacement too; use policy moevement (the stage is rebuilt past it) or none",
        engine::policy_name(job.policy), inj.iteration));
  }
  if (inj.what == injection::kind::stall && job.iteration_timeout_ms == 0) {
    fail(
        "a stall with cluster.iteration_timeout_ms = 0 would never end the job (its worker stays "
        "alive, so no loss is found); give the iteration a time limit");
  }
  if (inj.whole_host && job.backend != "slurm") {
    fail(
        "scope=host on the local backend would end every worker (they all run on this host): "
        "use it with cluster.backend = \"slurm\" on several nodes");
  }
  if (inj.during_recovery && engine::recovery_of(job.policy) == engine::recovery_kind::none) {
    fail(
        fmt::format("during=recovery needs a policy that recovers (moevement, dense-memory, "
                    "dense-disk or pec; policy {} does not, so no recovery ever starts)",
                    engine::policy_name(job.policy)));
  }
  return {};
}

}  // namespace moevement::launcher
