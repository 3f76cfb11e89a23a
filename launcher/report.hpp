// `moevement report RUN.jsonl [MORE.jsonl ...] [-o report.html]`: a run's story in one
// self-contained HTML file (inline SVG and CSS, nothing fetched): throughput over wall time
// with every failure, injection and recovery marked, the loss over iterations, the
// checkpointing's per-iteration costs, and a table of the recoveries. Several run logs are
// overlaid (a side-by-side of policies). A truncated or corrupt run log renders what it holds
// and says where it stopped; a file that is not a run log is an error.
#pragma once

#include <string>
#include <vector>

namespace moevement::launcher {

// Writes the report of `run_logs` to `out_path`. Throws std::runtime_error naming the file
// that is not a run log or cannot be written, std::invalid_argument when `out_path` is one of
// the run logs.
void write_report(const std::vector<std::string>& run_logs, const std::string& out_path);

int run_report(int argc, char** argv);

}  // namespace moevement::launcher
