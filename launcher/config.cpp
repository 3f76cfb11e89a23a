#include "launcher/config.hpp"

#include <fmt/format.h>

#include <filesystem>

#include <toml++/toml.h>
#include <unistd.h>

#include <charconv>
#include <cstdlib>
#include <stdexcept>

namespace moevement::launcher {

namespace {

void flatten(const toml::table& t, const std::string& prefix, models::config_map& out,
             const std::string& path) {
  for (const auto& [k, node] : t) {
    const std::string key =
        prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const auto* sub = node.as_table()) {
      flatten(*sub, key, out, path);
    } else if (const auto* i = node.as_integer()) {
      out[key] = i->get();
    } else if (const auto* f = node.as_floating_point()) {
      out[key] = f->get();
    } else if (const auto* b = node.as_boolean()) {
      out[key] = b->get();
    } else if (const auto* s = node.as_string()) {
      out[key] = s->get();
    } else if (const auto* a = node.as_array(); a != nullptr && a->is_array_of_tables()) {
      // [[name]] tables: the i-th (from 0) becomes name.i.KEY (failure injections: [[inject]]).
      for (std::size_t i = 0; i < a->size(); ++i) {
        flatten(*a->get(i)->as_table(), key + "." + std::to_string(i), out, path);
      }
    } else {
      throw models::config_error(
          key, fmt::format("{} line {}: unsupported value type (use a boolean, number or string)",
                           path, node.source().begin.line));  // arrays of values too
    }
  }
}

}  // namespace

models::config_map load_config_file(const std::string& path) {
  // toml++ reads a directory as an empty file: an empty config would run every default.
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) {
    throw std::runtime_error(fmt::format("{}: no such config file", path));
  }
  if (!std::filesystem::is_regular_file(status)) {
    throw std::runtime_error(
        fmt::format("{}: not a config file (a directory or special file); give the TOML file's "
                    "path",
                    path));
  }
  toml::table t;
  try {
    t = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw std::runtime_error(
        fmt::format("{} line {}: {}", path, e.source().begin.line, e.description()));
  }
  // The simulator's configs and profiles are not jobs: said before a key of theirs is
  // refused for what it is.
  if ((t.contains("plan") && t.contains("failures")) || t.contains("profile")) {
    throw std::runtime_error(fmt::format(
        "{}: an ETTR simulation's config or measured profile ([plan] and [failures], or "
        "[profile]), not a job's: `moevement simulate` reads it (docs/simulator.md)",
        path));
  }
  models::config_map out;
  flatten(t, "", out, path);
  return out;
}

void apply_override(models::config_map& map, std::string_view assignment) {
  const auto eq = assignment.find('=');
  if (eq == std::string_view::npos || eq == 0) {
    throw std::runtime_error(fmt::format("--set '{}': expected key=value", assignment));
  }
  const std::string key(assignment.substr(0, eq));
  std::string_view v = assignment.substr(eq + 1);
  if (v == "true" || v == "false") {
    map[key] = v == "true";
    return;
  }
  std::int64_t i = 0;
  const auto [ip, iec] = std::from_chars(v.data(), v.data() + v.size(), i);
  if (iec == std::errc() && ip == v.data() + v.size() && !v.empty()) {
    map[key] = i;
    return;
  }
  const std::string s(v);
  char* end = nullptr;
  const double d = std::strtod(s.c_str(), &end);
  if (!s.empty() && end == s.c_str() + s.size()) {
    map[key] = d;
    return;
  }
  if (v.size() >= 2 && (v.front() == '"' || v.front() == '\'') && v.back() == v.front()) {
    v = v.substr(1, v.size() - 2);
  }
  map[key] = std::string(v);
}

bool is_engine_section(std::string_view key) {
  for (const std::string_view s :
       {"parallel.", "checkpoint.", "cluster.", "failure.", "engine.", "inject."}) {
    if (key.starts_with(s)) return true;
  }
  return false;
}

long flag_number(const std::string& flag, const std::string& value, long lo, long hi) {
  char* end = nullptr;
  const long x = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || x < lo || x > hi) {
    throw std::invalid_argument(
        fmt::format("{}: expected an integer in [{}, {}], got '{}'", flag, lo, hi, value));
  }
  return x;
}

std::uint64_t micro_batch_floor_bytes(const models::model_config& model,
                                      const models::train_config& train) {
  return std::uint64_t(train.micro_batch_size) * std::uint64_t(train.seq_len) *
         (std::uint64_t(model.vocab) + std::uint64_t(model.d_model)) * sizeof(float);
}

void check_host_memory(const models::model_config& model, const models::train_config& train,
                       std::uint64_t host_bytes) {
  if (host_bytes == 0) {
    host_bytes = std::uint64_t(::sysconf(_SC_PHYS_PAGES)) * std::uint64_t(::sysconf(_SC_PAGESIZE));
  }
  const std::uint64_t need = micro_batch_floor_bytes(model, train);
  if (need > host_bytes) {
    throw models::config_error(
        "train.micro_batch_size",
        fmt::format("{} x seq_len {} needs at least {} bytes for one micro-batch's logits and "
                    "activations (B x T x (vocab + d_model) x 4), more than this host's {} "
                    "bytes of memory; lower it",
                    train.micro_batch_size, train.seq_len, need, host_bytes));
  }
}

}  // namespace moevement::launcher
