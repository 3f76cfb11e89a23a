#include "engine/run_log.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace moevement::engine {

std::string json_quote(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", c);
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

void json_record::key(std::string_view k) {
  if (!body_.empty()) body_ += ',';
  body_ += json_quote(k);
  body_ += ':';
}

json_record& json_record::add(std::string_view k, std::string_view value) {
  key(k);
  body_ += json_quote(value);
  return *this;
}

json_record& json_record::add(std::string_view k, double value) {
  key(k);
  // JSON has no NaN or infinity; a diverged loss is recorded as null.
  body_ += std::isfinite(value) ? fmt::format("{}", value) : "null";
  return *this;
}

json_record& json_record::add(std::string_view k, std::int64_t value) {
  key(k);
  body_ += fmt::format("{}", value);
  return *this;
}

json_record& json_record::add(std::string_view k, std::uint64_t value) {
  key(k);
  body_ += fmt::format("{}", value);
  return *this;
}

json_record& json_record::add(std::string_view k, bool value) {
  key(k);
  body_ += value ? "true" : "false";
  return *this;
}

run_log::run_log(const std::filesystem::path& path, bool append) : path_(path) {
  // Private whatever the umask: the log names hosts, pids and the job's progress. Appending
  // always: processes write it in turn (a head, its standby that took over, the head's last
  // word once the standby ended), and a write at a stale offset overwrote the standby's records.
  const int fd = ::open(path.c_str(),
                        O_WRONLY | O_CREAT | O_APPEND | (append ? 0 : O_TRUNC) | O_CLOEXEC, 0600);
  if (fd >= 0 && ::fchmod(fd, 0600) == 0) fd_ = fd;
  if (fd_ < 0 && fd >= 0) ::close(fd);
  if (fd_ < 0) {
    throw std::runtime_error(
        fmt::format("cannot open run log {}: {} (check that the directory "
                    "exists and is writable)",
                    path.string(), std::strerror(errno)));
  }
  // A log whose last line a killed head left torn: what is appended starts on a line of its
  // own (the reader then skips the torn one, not everything after it).
  if (append) start_on_new_line();
}

void run_log::start_on_new_line() {
  std::ifstream in(path_, std::ios::binary | std::ios::ate);
  if (!in || in.tellg() <= 0) return;
  in.seekg(-1, std::ios::end);
  if (in.get() == '\n') return;
  append_line("\n");
}

run_log::~run_log() {
  if (fd_ >= 0) ::close(fd_);
}

void run_log::write(const json_record& record) {
  append_line(record.str() + "\n");
}

void run_log::append_line(const std::string& line) {
  // One write() per record, with no stdio buffer between: an O_APPEND write lands whole at the
  // end of the file, so a record of another process appending to the same log (a head and its
  // standby) never falls inside this one, however long it is.
  std::size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw std::runtime_error(
          fmt::format("writing run log {} failed: {} (check the disk's free "
                      "space)",
                      path_.string(), std::strerror(errno)));
    }
    done += static_cast<std::size_t>(n);
  }
}

}  // namespace moevement::engine
