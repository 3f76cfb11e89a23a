// docs/benchmarks.md checked against itself and the benchmarks: its figures are copied from the
// benchmarks' output, so a row whose ratio is not what its two figures give (as printed, each
// to its last digit) was copied wrong; every benchmark `moevement bench` lists has a section
// naming its command, and every `moevement bench NAME` the page names exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/run_moevement.hpp"

namespace {

std::string source_root() {
  const char* root = std::getenv("MOEVEMENT_SOURCE_ROOT");
  if (root == nullptr) throw std::runtime_error("MOEVEMENT_SOURCE_ROOT is not set");
  return root;
}

std::vector<std::string> page() {
  std::ifstream in(source_root() + "/docs/benchmarks.md");
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

std::vector<std::string> cells_of(const std::string& row) {
  std::vector<std::string> out;
  std::size_t at = 1;
  for (std::size_t bar; (bar = row.find('|', at)) != std::string::npos; at = bar + 1) {
    std::string c = row.substr(at, bar - at);
    const auto b = c.find_first_not_of(' '), e = c.find_last_not_of(' ');
    out.push_back(b == std::string::npos ? "" : c.substr(b, e - b + 1));
  }
  return out;
}

// A figure as printed: its value and half a unit of its last digit. Only a cell that is a
// number, optionally with a unit (`9.249 us`), counts; prose, ranges and names do not.
struct figure {
  double value = 0, half_ulp = 0;
};

std::optional<figure> figure_of(const std::string& cell) {
  std::size_t i = 0;
  while (i < cell.size() && (std::isdigit(static_cast<unsigned char>(cell[i])) || cell[i] == '.'))
    ++i;
  if (i == 0) return std::nullopt;
  const std::string digits = cell.substr(0, i);
  const std::string rest = cell.substr(i);
  // a unit of letters and '/' after one space, and nothing else
  if (!rest.empty()) {
    if (rest[0] != ' ' || rest.size() < 2) return std::nullopt;
    for (std::size_t k = 1; k < rest.size(); ++k) {
      const char c = rest[k];
      if (!std::isalpha(static_cast<unsigned char>(c)) && c != '/') return std::nullopt;
    }
  }
  if (std::count(digits.begin(), digits.end(), '.') > 1) return std::nullopt;
  const auto dot = digits.find('.');
  const int decimals = dot == std::string::npos ? 0 : int(digits.size() - dot - 1);
  return figure{std::strtod(digits.c_str(), nullptr), 0.5 * std::pow(10.0, -decimals)};
}

std::string unit_of(const std::string& cell) {
  const auto sp = cell.find(' ');
  return sp == std::string::npos ? "" : cell.substr(sp + 1);
}

// Whether a row's ratio is theirs/ours or ours/theirs of its figures; nullopt: a row whose
// cells are not all plain figures (prose, ranges, names), which is not checked.
std::optional<bool> ratio_fits(const std::vector<std::string>& c) {
  const auto ours = figure_of(c[1]), theirs = figure_of(c[2]), ratio = figure_of(c[3]);
  if (!ours || !theirs || !ratio || unit_of(c[1]) != unit_of(c[2]) || !unit_of(c[3]).empty())
    return std::nullopt;
  if (ours->value <= ours->half_ulp || theirs->value <= theirs->half_ulp) return std::nullopt;
  // The ratio of the unrounded figures lies in these bounds; the printed ratio is within half
  // its own last digit of it.
  const double lo = (theirs->value - theirs->half_ulp) / (ours->value + ours->half_ulp);
  const double hi = (theirs->value + theirs->half_ulp) / (ours->value - ours->half_ulp);
  auto fits = [&](double a, double b) {
    return ratio->value + ratio->half_ulp >= a && ratio->value - ratio->half_ulp <= b;
  };
  return fits(lo, hi) || fits(1 / hi, 1 / lo);
}

TEST(benchmarks_doc, every_ratio_is_what_its_two_figures_give) {
  int checked = 0;
  const auto lines = page();
  ASSERT_FALSE(lines.empty());
  for (std::size_t n = 0; n < lines.size(); ++n) {
    const std::string& l = lines[n];
    if (l.rfind("| ", 0) != 0 || l.rfind("| what", 0) == 0) continue;
    const auto c = cells_of(l);
    ASSERT_EQ(c.size(), 6u) << "docs/benchmarks.md:" << n + 1
                            << ": a row has what, ours, competitor, ratio, machine, date";
    const auto fits = ratio_fits(c);
    if (!fits) continue;
    EXPECT_TRUE(*fits) << "docs/benchmarks.md:" << n + 1 << ": ratio " << c[3]
                       << " is neither theirs/ours nor ours/theirs of " << c[1] << " and " << c[2];
    ++checked;
  }
  EXPECT_GE(checked, 15) << "the check found few rows it could read: has the table format changed?";
}

// scripts/bench-rows makes the rows from a benchmark's own output lines, which the check above
// then reads; input without such a line is an error.
TEST(benchmarks_doc, bench_rows_makes_rows_from_a_benchmarks_output) {
  const std::string script = source_root() + "/scripts/bench-rows";
  auto run = [&](const std::string& input) {
    const std::string cmd = "printf '" + input + "' | " + script + " 2>&1";
    std::string out;
    FILE* p = ::popen(cmd.c_str(), "r");
    char buf[512];
    while (p != nullptr && std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
    const int status = p != nullptr ? ::pclose(p) : -1;
    return std::make_pair(status, out);
  };
  const auto [status, out] =
      run("# a comment\\nreload_s: ours=12.8926 theirs=12.1568 ratio=0.943\\nnoise: 3\\n");
  ASSERT_EQ(status, 0) << out;
  EXPECT_EQ(out.rfind("| reload_s | 12.8926 | 12.1568 | 0.943 | ", 0), 0u) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  const auto fits = ratio_fits(cells_of(out.substr(0, out.find('\n'))));
  ASSERT_TRUE(fits.has_value()) << out;
  EXPECT_TRUE(*fits) << out;
  const auto [bad, why] = run("no figures here\\n");
  EXPECT_NE(bad, 0);
  EXPECT_NE(why.find("no \"metric: ours="), std::string::npos) << why;
}

TEST(benchmarks_doc, every_benchmark_has_a_section_with_its_command) {
  const auto listed = moevement::test_support::run_moevement("bench");
  std::set<std::string> names;
  std::istringstream in(listed.output);
  bool in_list = false;
  for (std::string l; std::getline(in, l);) {
    if (l == "benchmarks:") {
      in_list = true;
      continue;
    }
    if (in_list && l.rfind("  ", 0) == 0) names.insert(l.substr(2, l.find(' ', 2) - 2));
  }
  ASSERT_GE(names.size(), 5u) << listed.output;
  std::string text;
  for (const auto& l : page()) text += l + "\n";
  // A command is `moevement bench NAME ...` or the executable itself, `build/bench/bench_NAME`.
  for (const auto& name : names) {
    EXPECT_TRUE(text.find("moevement bench " + name) != std::string::npos ||
                text.find("bench/bench_" + name) != std::string::npos)
        << "docs/benchmarks.md has no command of `moevement bench " << name << "`";
  }
  for (const std::string prefix : {"moevement bench ", "bench/bench_"}) {
    for (std::size_t at = 0; (at = text.find(prefix, at)) != std::string::npos;) {
      at += prefix.size();
      std::size_t e = at;
      while (e < text.size() && std::isalnum(static_cast<unsigned char>(text[e]))) ++e;
      const std::string name = text.substr(at, e - at);
      if (!name.empty()) {
        EXPECT_TRUE(names.contains(name)) << "docs/benchmarks.md names the benchmark " << name
                                          << ", which `moevement bench` does not list";
      }
    }
  }
}

}  // namespace
