// Reading a run log (engine.run_log, JSONL) back: every line one flat JSON object, as run_log
// writes them. A run log is a file from disk, so it is untrusted: each line is parsed strictly;
// a line that is not such an object is skipped when records follow it (a run killed mid-write,
// then resumed into the same log), and otherwise ends the reading (a truncated last line),
// saying where and why.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "base/result.hpp"

namespace moevement::engine {

// One record: its keys with a number, string, bool or null (monostate) each.
class run_record {
 public:
  using value = std::variant<std::monostate, bool, double, std::string>;

  std::optional<double> number(std::string_view key) const;
  std::optional<std::string> text(std::string_view key) const;
  bool is(std::string_view key, std::string_view value) const;  // text(key) == value
  bool has(std::string_view key) const { return fields_.find(key) != fields_.end(); }
  const std::map<std::string, value, std::less<>>& fields() const { return fields_; }

  // Parses one line; an error says what is wrong and at which byte.
  static result<run_record> parse(std::string_view line);

 private:
  std::map<std::string, value, std::less<>> fields_;
};

struct run_log_contents {
  std::vector<run_record> records;
  std::size_t lines = 0;  // lines read, the bad one included
  // Where reading stopped early ("line 812: expected ',' or '}' at byte 40"), or empty.
  std::string stopped;
  // Lines that did not parse but had records after them (a line torn by a killed head, then a
  // resume's records appended): skipped, the first few said ("line 908: ..."), all counted.
  std::vector<std::string> skipped;
  std::size_t skipped_lines = 0;
};

// Reads the run log at `path`. Fails (a clear error) when it cannot be opened, or when not one
// record could be read from it: then it is not a run log. Lines over max_line_bytes stop it.
result<run_log_contents> read_run_log(const std::string& path,
                                      std::size_t max_line_bytes = std::size_t(1) << 20);

// The newest iteration whose record the run log at `path` holds, read from its last `tail`
// bytes (a standby head that took over: what the lost head logged); none when there is none.
std::optional<std::int64_t> last_logged_iteration(const std::string& path,
                                                  std::size_t tail = std::size_t(1) << 20);
// Whether the run log at `path` ends its last run (job_end, job_failed or job_stopped after
// its last job_start; records may follow, such as the last durable writes; read from its last
// `tail` bytes).
bool run_log_ended(const std::string& path, std::size_t tail = std::size_t(1) << 20);
// Whether the last run in the log is a standby head's that took the job over (its job_start
// says `takeover`). Reads further back than `tail` bytes until it finds the run's job_start.
bool run_log_taken_over(const std::string& path, std::size_t tail = std::size_t(1) << 20);

}  // namespace moevement::engine
