// docs/configuration.md is the configuration reference: every key the parser accepts must be
// in it, and every literal default it states must be the default in models/config.hpp.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include "models/config.hpp"

namespace moevement::models {
namespace {

struct documented_key {
  std::string key;
  std::string default_text;  // as written between backticks, or "preset"
};

// The `...` tokens of one table cell.
std::vector<std::string> ticked(const std::string& cell) {
  std::vector<std::string> out;
  for (std::size_t a = cell.find('`'); a != std::string::npos; a = cell.find('`', a)) {
    const std::size_t b = cell.find('`', a + 1);
    if (b == std::string::npos) break;
    out.push_back(cell.substr(a + 1, b - a - 1));
    a = b + 1;
  }
  return out;
}

// Rows of the form | `k1`, `k2` | `v1`, `v2` | meaning |  (no std::regex: g++ 12 warns
// falsely inside it under the sanitizers).
std::vector<documented_key> read_reference() {
  const char* root = std::getenv("MOEVEMENT_SOURCE_ROOT");
  if (root == nullptr) throw std::runtime_error("MOEVEMENT_SOURCE_ROOT is not set");
  std::ifstream in(std::string(root) + "/docs/configuration.md");
  if (!in) throw std::runtime_error("cannot open docs/configuration.md");
  std::vector<documented_key> out;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.starts_with("| `")) continue;
    const std::size_t bar1 = line.find('|', 1);
    const std::size_t bar2 = bar1 == std::string::npos ? bar1 : line.find('|', bar1 + 1);
    if (bar2 == std::string::npos) continue;
    const auto keys = ticked(line.substr(1, bar1 - 1));
    const std::string values_text = line.substr(bar1 + 1, bar2 - bar1 - 1);
    const auto values = ticked(values_text);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (keys[i].find('.') == std::string::npos) continue;
      std::string fallback = values_text;
      fallback.erase(0, fallback.find_first_not_of(' '));
      fallback.erase(fallback.find_last_not_of(' ') + 1);
      out.push_back({keys[i], i < values.size() ? values[i] : fallback});
    }
  }
  return out;
}

config_value parse_literal(const std::string& text) {
  if (text == "true") return true;
  if (text == "false") return false;
  char* end = nullptr;
  const long long i = std::strtoll(text.c_str(), &end, 10);
  if (*end == '\0' && !text.empty()) return std::int64_t(i);
  const double d = std::strtod(text.c_str(), &end);
  if (*end == '\0' && !text.empty()) return d;
  return text;
}

TEST(config_doc, every_key_the_parser_accepts_is_documented) {
  std::set<std::string> documented;
  for (const auto& d : read_reference()) documented.insert(d.key);
  for (const auto& key : config_keys()) {
    EXPECT_TRUE(documented.count(key)) << key << " is accepted but not in docs/configuration.md";
  }
}

TEST(config_doc, every_documented_model_and_train_key_exists_with_its_default) {
  const auto keys = config_keys();
  const std::set<std::string> accepted(keys.begin(), keys.end());
  int checked = 0;
  for (const auto& d : read_reference()) {
    if (!d.key.starts_with("model.") && !d.key.starts_with("train.")) continue;
    EXPECT_TRUE(accepted.count(d.key)) << d.key << " is documented but the parser rejects it";
    if (d.default_text == "preset" || d.key == "model.preset") continue;
    // Applying the documented default to the defaults must change nothing.
    config_map map{{d.key, parse_literal(d.default_text)}};
    model_config model;
    train_config train;
    apply_config(map, model, train);
    EXPECT_TRUE(model == model_config{} && train == train_config{})
        << d.key << ": docs say `" << d.default_text << "`, models/config.hpp says otherwise";
    ++checked;
  }
  EXPECT_GT(checked, 15) << "the reference tables were not found or not parsed";
}

}  // namespace
}  // namespace moevement::models
