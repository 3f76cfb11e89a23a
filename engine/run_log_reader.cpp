#include "engine/run_log_reader.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace moevement::engine {
namespace {

constexpr std::size_t max_skipped_said = 5;  // the skipped lines' reasons kept

// A strict reader of one flat JSON object: string keys; string, number, bool or null values.
class line_parser {
 public:
  explicit line_parser(std::string_view s) : s_(s) {}

  result<std::map<std::string, run_record::value, std::less<>>> object() {
    std::map<std::string, run_record::value, std::less<>> out;
    skip_space();
    if (!take('{')) return fail("expected '{'");
    skip_space();
    if (take('}')) return finish(std::move(out));
    for (;;) {
      skip_space();
      auto key = string();
      if (!key.ok()) return key.err();
      skip_space();
      if (!take(':')) return fail("expected ':'");
      skip_space();
      auto v = value();
      if (!v.ok()) return v.err();
      out[std::move(*key)] = std::move(*v);
      skip_space();
      if (take('}')) return finish(std::move(out));
      if (!take(',')) return fail("expected ',' or '}'");
    }
  }

 private:
  error fail(const std::string& what) const {
    return error{fmt::format("{} at byte {}", what, i_)};
  }
  bool take(char c) {
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void skip_space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  result<std::map<std::string, run_record::value, std::less<>>> finish(
      std::map<std::string, run_record::value, std::less<>> out) {
    skip_space();
    if (i_ != s_.size()) return fail("text after the object");
    return out;
  }

  result<run_record::value> value() {
    if (i_ >= s_.size()) return fail("expected a value");
    const char c = s_[i_];
    if (c == '"') {
      auto str = string();
      if (!str.ok()) return str.err();
      return run_record::value{std::move(*str)};
    }
    if (s_.substr(i_).starts_with("true")) {
      i_ += 4;
      return run_record::value{true};
    }
    if (s_.substr(i_).starts_with("false")) {
      i_ += 5;
      return run_record::value{false};
    }
    if (s_.substr(i_).starts_with("null")) {
      i_ += 4;
      return run_record::value{};
    }
    return number();
  }

  result<run_record::value> number() {
    const std::size_t start = i_;
    while (i_ < s_.size() &&
           std::string_view("+-0123456789.eE").find(s_[i_]) != std::string_view::npos) {
      ++i_;
    }
    if (i_ == start) return fail("expected a value");
    const std::string text(s_.substr(start, i_ - start));
    char* end = nullptr;
    errno = 0;
    const double d = std::strtod(text.c_str(), &end);
    // Underflow (1e-400) reads as 0 or a denormal; only overflow is refused.
    if (end != text.c_str() + text.size() || (errno == ERANGE && std::isinf(d))) {
      i_ = start;
      return fail("not a number");
    }
    return run_record::value{d};
  }

  result<std::string> string() {
    if (!take('"')) return fail("expected a string");
    std::string out;
    while (i_ < s_.size()) {
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) return fail("a control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) break;
      const char e = s_[i_++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          if (i_ + 4 > s_.size()) return fail("a short \\u escape");
          unsigned long cp = 0;
          for (std::size_t k = 0; k < 4; ++k) {
            const char h = s_[i_ + k];
            const int d = h >= '0' && h <= '9'   ? h - '0'
                          : h >= 'a' && h <= 'f' ? h - 'a' + 10
                          : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                                 : -1;
            if (d < 0) return fail("a bad \\u escape");
            cp = cp * 16 + unsigned(d);
          }
          i_ += 4;
          append_utf8(out, cp >= 0xD800 && cp <= 0xDFFF ? 0xFFFD : cp);  // no surrogate pairs
          break;
        }
        default:
          return fail("an unknown escape");
      }
    }
    return fail("an unterminated string");
  }

  static void append_utf8(std::string& out, unsigned long cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xE0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }

  std::string_view s_;
  std::size_t i_ = 0;
};

}  // namespace

std::optional<double> run_record::number(std::string_view key) const {
  const auto it = fields_.find(key);
  if (it == fields_.end()) return std::nullopt;
  if (const auto* d = std::get_if<double>(&it->second)) return *d;
  return std::nullopt;
}

std::optional<std::string> run_record::text(std::string_view key) const {
  const auto it = fields_.find(key);
  if (it == fields_.end()) return std::nullopt;
  if (const auto* s = std::get_if<std::string>(&it->second)) return *s;
  return std::nullopt;
}

bool run_record::is(std::string_view key, std::string_view value) const {
  const auto it = fields_.find(key);
  if (it == fields_.end()) return false;
  const auto* s = std::get_if<std::string>(&it->second);
  return s != nullptr && *s == value;
}

result<run_record> run_record::parse(std::string_view line) {
  auto fields = line_parser(line).object();
  if (!fields.ok()) return fields.err();
  run_record r;
  r.fields_ = std::move(*fields);
  if (!r.text("kind")) return error{"no \"kind\" (every run log record has one)"};
  return r;
}

result<run_log_contents> read_run_log(const std::string& path, std::size_t max_line_bytes) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return error{
        fmt::format("{} is a directory, not a run log (name the .jsonl file in it)", path)};
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return error{fmt::format("cannot open {}", path)};
  run_log_contents out;
  std::string line;
  // The first of the lines since the last record that did not parse, and how many there are:
  // skipped once a record follows them, where reading stopped otherwise.
  std::string bad;
  std::size_t bad_lines = 0;
  while (in.peek() != std::char_traits<char>::eof()) {
    ++out.lines;
    // Read up to the newline, but never hold more than max_line_bytes of one line.
    line.clear();
    bool too_long = false;
    for (int c = in.get(); c != std::char_traits<char>::eof() && c != '\n'; c = in.get()) {
      if (line.size() == max_line_bytes) {
        too_long = true;
        break;
      }
      line += char(c);
    }
    if (too_long) {
      out.stopped = fmt::format("line {}: longer than {} bytes", out.lines, max_line_bytes);
      break;
    }
    if (line.empty()) continue;
    auto r = run_record::parse(line);
    if (!r.ok()) {
      if (bad_lines++ == 0) bad = fmt::format("line {}: {}", out.lines, r.err().message);
      continue;
    }
    if (bad_lines > 0) {  // a record after them: they were torn, not the end
      out.skipped_lines += bad_lines;
      if (out.skipped.size() < max_skipped_said) out.skipped.push_back(bad);
      bad_lines = 0;
    }
    out.records.push_back(std::move(*r));
  }
  if (bad_lines > 0 && out.stopped.empty()) out.stopped = bad;  // a torn end, or garbage
  if (out.records.empty()) {
    return error{fmt::format("{} is not a run log ({})", path,
                             out.stopped.empty() ? "it is empty" : out.stopped)};
  }
  return out;
}

namespace {

// The records of the last `tail` bytes of the run log at `path`, oldest first (a part line at
// their start and lines that do not parse, such as a torn last one, left out).
std::vector<run_record> tail_records(const std::string& path, std::size_t tail) {
  std::vector<run_record> out;
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return out;
  const auto size = std::size_t(in.tellg());
  in.seekg(std::streamoff(size > tail ? size - tail : 0));
  std::string line;
  if (size > tail) std::getline(in, line);  // a part of a line
  while (std::getline(in, line)) {
    if (auto r = run_record::parse(line); r.ok()) out.push_back(std::move(*r));
  }
  return out;
}

}  // namespace

std::optional<std::int64_t> last_logged_iteration(const std::string& path, std::size_t tail) {
  std::optional<std::int64_t> newest;
  for (const run_record& r : tail_records(path, tail)) {
    if (!r.is("kind", "iteration")) continue;
    if (const auto it = r.number("iteration"); it && *it >= 0 && *it < 9.0e15) {
      newest = std::max(newest.value_or(0), std::int64_t(*it));
    }
  }
  return newest;
}

bool run_log_ended(const std::string& path, std::size_t tail) {
  const auto records = tail_records(path, tail);
  if (records.empty()) return false;
  // The last run's end, with what its stages still logged after it (their last durable
  // writes) behind it.
  for (auto r = records.rbegin(); r != records.rend(); ++r) {
    if (r->is("event", "job_end") || r->is("event", "job_failed") ||
        r->is("event", "job_stopped")) {
      return true;
    }
    if (r->is("event", "job_start")) return false;
  }
  return false;
}

bool run_log_taken_over(const std::string& path, std::size_t tail) {
  // Further back until a job_start (a standby that ran long after it took over logged more
  // than `tail` since), the whole file at most.
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  for (std::size_t t = std::max<std::size_t>(tail, 1);; t *= 4) {
    const auto records = tail_records(path, t);
    for (auto r = records.rbegin(); r != records.rend(); ++r) {
      if (r->is("event", "job_start")) return r->has("takeover");
    }
    if (ec || t >= size) return false;
  }
}

}  // namespace moevement::engine
