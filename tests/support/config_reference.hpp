// Reads the key tables of docs/configuration.md for the tests that check it against the
// parsers (tests/models/config_doc_test.cpp, tests/engine/config_doc_test.cpp).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/config.hpp"

namespace moevement::test_support {

struct documented_key {
  std::string key;
  std::string default_text;  // as written between backticks, or the cell's text ("preset")
};

// The `...` tokens of one table cell.
inline std::vector<std::string> ticked(const std::string& cell) {
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
inline std::vector<documented_key> read_reference() {
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

// A documented default as the config parser would type it.
inline models::config_value parse_literal(const std::string& text) {
  if (text == "true") return true;
  if (text == "false") return false;
  char* end = nullptr;
  const long long i = std::strtoll(text.c_str(), &end, 10);
  if (*end == '\0' && !text.empty()) return std::int64_t(i);
  const double d = std::strtod(text.c_str(), &end);
  if (*end == '\0' && !text.empty()) return d;
  return text;
}

}  // namespace moevement::test_support
