// Whole-string number parsing for the text formats we write ourselves (checkpoint metadata,
// journals): the whole of `s` must be the number, or nothing is stored.
#pragma once

#include <charconv>
#include <string_view>
#include <system_error>

namespace moevement {

template <class T>
bool parse_int(std::string_view s, T& out, int base = 10) {
  if (s.empty()) return false;
  T v{};
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, base);
  if (ec != std::errc() || p != s.data() + s.size()) return false;
  out = v;
  return true;
}

}  // namespace moevement
