#include "launcher/simulate.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "sim/report.hpp"

namespace moevement::launcher {
namespace {

constexpr const char* usage =
    "usage: moevement simulate CONFIG [--set key=value ...] [--csv FILE] [--sweep]\n"
    "  CONFIG       TOML file (examples/configs/simulate_*.toml; keys in docs/simulator.md)\n"
    "  --set k=v    override one key, e.g. --set failures.mtbf_minutes=[60,10]\n"
    "  --csv FILE   also write every row as CSV\n"
    "  --sweep      run the scale study (paper Figure 11) instead of the table\n";

// A --csv path that would overwrite what the simulation reads, or cannot be written: refused
// before the simulation runs (it may take minutes), not after.
void check_csv_path(const std::string& csv, const std::vector<std::filesystem::path>& inputs) {
  std::error_code ec;
  const bool exists = std::filesystem::exists(csv, ec);
  for (const auto& in : inputs) {
    if (exists && std::filesystem::equivalent(csv, in, ec)) {
      throw std::runtime_error(fmt::format(
          "--csv {} is {}, which this simulation reads: it would be overwritten; write the CSV "
          "to another file",
          csv, in.string()));
    }
  }
  if (std::filesystem::is_directory(csv, ec)) {
    throw std::runtime_error(fmt::format("--csv {} is a directory: name a file", csv));
  }
  const std::filesystem::path parent = std::filesystem::path(csv).parent_path();
  const std::string dir = parent.empty() ? "." : parent.string();
  if (::access(exists ? csv.c_str() : dir.c_str(), W_OK) != 0) {
    throw std::runtime_error(fmt::format("cannot write --csv file '{}' ({}: {})", csv,
                                         exists ? csv : dir, std::strerror(errno)));
  }
}

}  // namespace

int run_simulate(int argc, char** argv, std::ostream& out, std::ostream& err) {
  std::string config, csv;
  std::vector<std::string> overrides;
  bool sweep = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--set" || a == "--csv") {
      if (i + 1 >= argc) {
        err << "moevement simulate: " << a << " needs a value\n" << usage;
        return 2;
      }
      (a == "--set" ? overrides.emplace_back() : csv) = argv[++i];
    } else if (a.starts_with("--set=")) {
      overrides.push_back(a.substr(6));
    } else if (a.starts_with("--csv=")) {
      csv = a.substr(6);
    } else if (a == "--sweep") {
      sweep = true;
    } else if (a == "--help" || a == "-h") {
      out << usage;
      return 0;
    } else if (a.starts_with("-") || !config.empty()) {
      err << "moevement simulate: unexpected argument '" << a << "'\n" << usage;
      return 2;
    } else {
      config = a;
    }
  }
  if (config.empty()) {
    err << "moevement simulate: no CONFIG given\n" << usage;
    return 2;
  }
  try {
    const auto cfg = sim::load_config(config, overrides);
    if (!csv.empty()) check_csv_path(csv, cfg.files);
    std::vector<sim::simulation_result> results;
    if (sweep) {
      results = sim::run_sweep(cfg);
      sim::print_sweep(out, results);
    } else {
      results.push_back(sim::run_simulation(cfg));
      sim::print_table(out, cfg, results.front());
    }
    if (!csv.empty()) {
      std::ofstream f(csv);
      if (!f) throw std::runtime_error("cannot write --csv file '" + csv + "'");
      sim::write_csv_header(f);
      for (const auto& r : results) sim::write_csv_rows(f, r);
      if (!f.flush()) throw std::runtime_error("writing --csv file '" + csv + "' failed");
    }
  } catch (const std::exception& e) {
    err << "moevement simulate: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace moevement::launcher
