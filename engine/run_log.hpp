// The JSONL run log: one record per line, one per iteration and one per event (failure,
// recovery start/end, snapshot persisted). Tools and tests read it back line by line.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace moevement::engine {

// One JSON object, built field by field in the order given.
class json_record {
 public:
  json_record& add(std::string_view key, std::string_view value);
  json_record& add(std::string_view key, const char* value) {
    return add(key, std::string_view(value));
  }
  json_record& add(std::string_view key, double value);
  json_record& add(std::string_view key, std::int64_t value);
  json_record& add(std::string_view key, std::uint64_t value);
  json_record& add(std::string_view key, int value) { return add(key, std::int64_t{value}); }
  json_record& add(std::string_view key, bool value);
  // The finished object, e.g. {"kind":"iteration","loss":2.5}.
  std::string str() const { return "{" + body_ + "}"; }

 private:
  void key(std::string_view k);
  std::string body_;
};

// JSON string escaping (quotes included).
std::string json_quote(std::string_view s);

class run_log {
 public:
  // Truncates path (append: adds to it, as a resumed job does); throws with the path in the
  // message if it cannot be opened.
  explicit run_log(const std::filesystem::path& path, bool append = false);
  ~run_log();
  run_log(const run_log&) = delete;
  run_log& operator=(const run_log&) = delete;

  // Writes one line in one write() (no buffer), so a killed run keeps every record written
  // before and records of processes appending to the same log never interleave.
  void write(const json_record& record);
  // Ends a line another process left torn (a head killed mid-write into the log this one
  // appends to), so that the next record starts a line of its own.
  void start_on_new_line();
  // Seconds since the log was opened (the `time_s` of events, to line them up).
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - opened_).count();
  }

 private:
  std::chrono::steady_clock::time_point opened_ = std::chrono::steady_clock::now();
  void append_line(const std::string& line);
  int fd_ = -1;
  std::filesystem::path path_;
};

}  // namespace moevement::engine
