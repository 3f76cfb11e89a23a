#include "launcher/slurm_env.hpp"

#include <arpa/inet.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <unordered_set>

namespace moevement::launcher {
namespace {

[[noreturn]] void fail(std::string what) {
  throw slurm_env_error(std::move(what));
}

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.';
}

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// A decimal number of at most 9 digits (so it fits and a width stays sane).
std::uint32_t small_number(std::string_view s, std::string_view where) {
  if (!all_digits(s)) fail(fmt::format("'{}' in {} is not a number", s, where));
  if (s.size() > 9) fail(fmt::format("number '{}' in {} is too long", s, where));
  std::uint32_t v = 0;
  std::from_chars(s.data(), s.data() + s.size(), v);
  return v;
}

// One bracket group's body, e.g. "1-3,05": the numbers as strings, padded where asked.
std::vector<std::string> expand_ranges(std::string_view body, std::size_t budget) {
  if (body.empty()) fail("empty brackets []");
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= body.size()) {
    const auto comma = std::min(body.find(',', start), body.size());
    const auto part = body.substr(start, comma - start);
    if (part.empty()) fail(fmt::format("empty range in [{}]", body));
    const auto dash = part.find('-');
    const auto lo_text = part.substr(0, dash);
    const auto hi_text = dash == std::string_view::npos ? lo_text : part.substr(dash + 1);
    const auto where = fmt::format("[{}]", body);
    const auto lo = small_number(lo_text, where);
    const auto hi = small_number(hi_text, where);
    if (hi < lo) fail(fmt::format("range {} in [{}] is decreasing", part, body));
    // Slurm's rule: a leading zero on the lower bound makes every number that wide.
    const std::size_t width = lo_text.size() > 1 && lo_text[0] == '0' ? lo_text.size() : 0;
    if (width > 0 && hi_text.size() > width) {
      fail(fmt::format("range {} in [{}] mixes widths {} and {}", part, body, width,
                       hi_text.size()));
    }
    if (hi - lo >= budget || out.size() + (hi - lo) >= budget) {
      fail(fmt::format("[{}] expands to more than {} names", body, max_expanded_nodes));
    }
    for (std::uint32_t v = lo;; ++v) {
      out.push_back(fmt::format("{:0{}}", v, width));
      if (v == hi) break;
    }
    start = comma + 1;
  }
  return out;
}

// One top-level item: literal segments and bracket groups, expanded as their product.
void expand_item(std::string_view item, std::vector<std::string>& out) {
  if (item.empty()) fail("empty name (two commas in a row, or a comma at an end)");
  std::vector<std::string> partial{""};
  std::size_t i = 0;
  while (i < item.size()) {
    if (item[i] == '[') {
      const auto close = item.find(']', i);
      if (close == std::string_view::npos) fail(fmt::format("'[' without ']' in '{}'", item));
      const auto body = item.substr(i + 1, close - i - 1);
      if (body.find('[') != std::string_view::npos) {
        fail(fmt::format("nested '[' in '{}'", item));
      }
      const auto numbers = expand_ranges(body, max_expanded_nodes);
      if (partial.size() * numbers.size() + out.size() > max_expanded_nodes) {
        fail(fmt::format("'{}' expands to more than {} names", item, max_expanded_nodes));
      }
      std::vector<std::string> next;
      next.reserve(partial.size() * numbers.size());
      for (const auto& p : partial) {
        for (const auto& n : numbers) next.push_back(p + n);
      }
      partial = std::move(next);
      i = close + 1;
    } else if (item[i] == ']') {
      fail(fmt::format("']' without '[' in '{}'", item));
    } else if (is_name_char(item[i])) {
      for (auto& p : partial) p += item[i];
      ++i;
    } else {
      fail(fmt::format("character {} is not allowed in a node name ('{}')",
                       static_cast<unsigned>(static_cast<unsigned char>(item[i])), item));
    }
  }
  for (auto& p : partial) {
    if (p.size() > max_node_name) {
      fail(fmt::format("a name in '{}' is longer than {} characters", item, max_node_name));
    }
    out.push_back(std::move(p));
  }
}

std::string_view required(const std::function<const char*(const char*)>& lookup, const char* name) {
  const char* v = lookup(name);
  if (v == nullptr) {
    fail(
        fmt::format("{} is not set: run this inside a Slurm step (srun), or use the local "
                    "backend",
                    name));
  }
  return v;
}

std::uint64_t parse_id(const char* name, std::string_view text, std::uint64_t max) {
  std::uint64_t v = 0;
  const auto* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (!all_digits(text) || ec != std::errc{} || ptr != end || v > max) {
    fail(fmt::format("{}='{}' is not a whole number in 0..{}", name, text, max));
  }
  return v;
}

template <typename T>
T with_variable(const char* name, std::string_view text, T (*parse)(std::string_view)) {
  try {
    return parse(text);
  } catch (const slurm_env_error& e) {
    fail(fmt::format("{}='{}': {}", name, text, e.what()));
  }
}

void append_json_string(std::string& out, std::string_view s) {
  out += '"';
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
    } else {
      out += c;
    }
  }
  out += '"';
}

}  // namespace

std::vector<std::string> expand_node_list(std::string_view list) {
  if (list.empty()) fail("the node list is empty");
  std::vector<std::string> out;
  // Split at commas outside brackets.
  std::size_t start = 0, depth = 0;
  for (std::size_t i = 0; i <= list.size(); ++i) {
    if (i < list.size() && list[i] == '[') ++depth;
    if (i < list.size() && list[i] == ']' && depth > 0) --depth;
    if (i == list.size() || (list[i] == ',' && depth == 0)) {
      expand_item(list.substr(start, i - start), out);
      start = i + 1;
    }
  }
  std::unordered_set<std::string_view> seen;
  for (const auto& n : out) {
    if (!seen.insert(n).second) fail(fmt::format("node '{}' appears twice", n));
  }
  return out;
}

std::vector<int> expand_tasks_per_node(std::string_view text) {
  if (text.empty()) fail("the task counts are empty");
  std::vector<int> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const auto comma = std::min(text.find(',', start), text.size());
    auto part = text.substr(start, comma - start);
    std::uint32_t repeat = 1;
    if (const auto paren = part.find('('); paren != std::string_view::npos) {
      const auto rep = part.substr(paren);
      if (rep.size() < 4 || rep.substr(0, 2) != "(x" || rep.back() != ')') {
        fail(fmt::format("'{}' is not COUNT or COUNT(xREPEAT)", part));
      }
      repeat = small_number(rep.substr(2, rep.size() - 3), part);
      part = part.substr(0, paren);
    }
    const auto count = small_number(part, text);
    if (count == 0 || count > max_tasks) fail(fmt::format("task count {} is out of range", count));
    if (repeat == 0 || out.size() + repeat > max_expanded_nodes) {
      fail(fmt::format("repeat count {} is out of range", repeat));
    }
    out.insert(out.end(), repeat, static_cast<int>(count));
    start = comma + 1;
  }
  return out;
}

int slurm_env::node_index() const {
  const auto it = std::find(nodes.begin(), nodes.end(), node_name);
  return it == nodes.end() ? -1 : static_cast<int>(it - nodes.begin());
}

std::string slurm_env::to_json() const {
  std::string out = fmt::format(R"({{"proc_id":{},"ntasks":{},"node_name":)", proc_id, ntasks);
  append_json_string(out, node_name);
  out += fmt::format(R"(,"node_index":{},"nodes":[)", node_index());
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (i > 0) out += ',';
    append_json_string(out, nodes[i]);
  }
  out += R"(],"tasks_per_node":[)";
  for (std::size_t i = 0; i < tasks_per_node.size(); ++i) {
    out += fmt::format("{}{}", i > 0 ? "," : "", tasks_per_node[i]);
  }
  out += R"(],"launch_node_ipaddr":)";
  append_json_string(out, launch_node_ipaddr);
  out += fmt::format(R"(,"job_id":{},"step_id":{}}})", job_id,
                     step_id ? fmt::format("{}", *step_id) : "null");
  return out;
}

slurm_env parse_slurm_env(const std::function<const char*(const char*)>& lookup) {
  slurm_env env;
  const char* ntasks_name = lookup("SLURM_NTASKS") ? "SLURM_NTASKS" : "SLURM_STEP_NUM_TASKS";
  env.ntasks = static_cast<int>(parse_id(ntasks_name, required(lookup, ntasks_name), max_tasks));
  if (env.ntasks == 0) fail(fmt::format("{}=0: a step has at least one task", ntasks_name));
  env.proc_id =
      static_cast<int>(parse_id("SLURM_PROCID", required(lookup, "SLURM_PROCID"), max_tasks));
  if (env.proc_id >= env.ntasks) {
    fail(fmt::format("SLURM_PROCID={} is not below {}={}", env.proc_id, ntasks_name, env.ntasks));
  }

  const char* list_name = lookup("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST"
                          : lookup("SLURM_NODELIST")    ? "SLURM_NODELIST"
                                                        : "SLURM_JOB_NODELIST";
  env.nodes = with_variable(list_name, required(lookup, list_name), &expand_node_list);

  const auto node_name = required(lookup, "SLURMD_NODENAME");
  env.node_name = node_name;
  if (env.node_index() < 0) {
    fail(fmt::format("SLURMD_NODENAME='{}' is not in {}", node_name, list_name));
  }

  const char* tpn_name =
      lookup("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_TASKS_PER_NODE";
  if (const char* tpn = lookup(tpn_name)) {
    env.tasks_per_node = with_variable(tpn_name, tpn, &expand_tasks_per_node);
    if (env.tasks_per_node.size() != env.nodes.size()) {
      fail(fmt::format("{}='{}' names {} nodes but {} has {}", tpn_name, tpn,
                       env.tasks_per_node.size(), list_name, env.nodes.size()));
    }
  }

  if (const char* ip = lookup("SLURM_LAUNCH_NODE_IPADDR")) {
    unsigned char buf[16];
    if (::inet_pton(AF_INET, ip, buf) != 1 && ::inet_pton(AF_INET6, ip, buf) != 1) {
      fail(fmt::format("SLURM_LAUNCH_NODE_IPADDR='{}' is not an IPv4 or IPv6 address", ip));
    }
    env.launch_node_ipaddr = ip;
  }

  env.job_id = parse_id("SLURM_JOB_ID", required(lookup, "SLURM_JOB_ID"), UINT32_MAX);
  if (const char* step = lookup("SLURM_STEP_ID")) {
    env.step_id = parse_id("SLURM_STEP_ID", step, UINT32_MAX);
  }
  return env;
}

slurm_env slurm_env_from_process() {
  return parse_slurm_env([](const char* name) { return std::getenv(name); });
}

}  // namespace moevement::launcher
