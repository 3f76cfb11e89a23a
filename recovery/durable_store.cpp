#include "recovery/durable_store.hpp"

#include <fmt/format.h>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "base/hash.hpp"
#include "base/parse.hpp"
#include "recovery/atomic_file.hpp"

namespace moevement::recovery {
namespace {

constexpr const char* manifest_name = "MANIFEST";
constexpr const char* window_prefix = "window-";
// A window being rewritten is written whole here first (its name is no window's).
constexpr const char* staging_suffix = ".new";
// ... and where the old one steps aside, on a file system without RENAME_EXCHANGE.
constexpr const char* aside_suffix = ".old";

// What a rewrite leaves beside a window (no window's name).
bool is_staging(const std::string& name) {
  return name.rfind(window_prefix, 0) == 0 &&
         (name.ends_with(staging_suffix) || name.ends_with(aside_suffix));
}
// A manifest lists blobs; more lines than this is not a manifest we wrote.
constexpr std::size_t max_manifest_bytes = 1u << 20;

std::span<const std::byte> as_bytes(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

struct manifest_entry {
  std::string name;
  std::uint64_t bytes = 0;
  std::uint64_t hash = 0;
};

result<std::vector<manifest_entry>> parse_manifest(const std::string& text, std::uint64_t id) {
  const auto end_of_body = text.rfind("manifest-xxh64 ");
  if (end_of_body == std::string::npos || (end_of_body > 0 && text[end_of_body - 1] != '\n')) {
    return error{"manifest has no checksum line (torn or not a manifest)"};
  }
  const std::string body = text.substr(0, end_of_body);
  std::string sum_line = text.substr(end_of_body + 15);
  if (!sum_line.empty() && sum_line.back() == '\n') sum_line.pop_back();
  std::uint64_t want = 0;
  if (!parse_int(sum_line, want, 16) || sum_line.size() != 16) {
    return error{"manifest checksum line is malformed"};
  }
  if (xxhash64(as_bytes(body)) != want) return error{"manifest checksum mismatch (corrupt)"};

  std::istringstream in(body);
  std::string line;
  if (!std::getline(in, line) || line.rfind("moevement-durable-window ", 0) != 0) {
    return error{"manifest does not start with the moevement-durable-window header"};
  }
  std::uint64_t version = 0;
  if (!parse_int(line.substr(25), version) || version != durable_store::format_version) {
    return error{
        fmt::format("manifest format version '{}' is not {} (written by another "
                    "moevement version; load it with that version)",
                    line.substr(25), durable_store::format_version)};
  }
  std::uint64_t got_id = 0;
  if (!std::getline(in, line) || line.rfind("window ", 0) != 0 ||
      !parse_int(line.substr(7), got_id) || got_id != id) {
    return error{"manifest names another window than its directory"};
  }
  std::vector<manifest_entry> entries;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string tag, name, bytes, hash, extra;
    fields >> tag >> name >> bytes >> hash;
    manifest_entry e;
    if (tag != "blob" || (fields >> extra) || !valid_blob_name(name) ||
        !parse_int(bytes, e.bytes) || hash.size() != 16 || !parse_int(hash, e.hash, 16)) {
      return error{fmt::format("manifest line '{}' is malformed", line)};
    }
    e.name = name;
    entries.push_back(std::move(e));
  }
  return entries;
}

}  // namespace

bool valid_blob_name(const std::string& name) {
  if (name.empty() || name.size() > 128 || name[0] == '.' || name == manifest_name) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
}

durable_store::durable_store(std::filesystem::path dir) : dir_(std::move(dir)) {
  try {
    create_private_directories(dir_);
  } catch (const std::exception& e) {
    throw std::runtime_error(
        fmt::format("cannot create the durable checkpoint directory: {}", e.what()));
  }
}

std::filesystem::path durable_store::window_dir(std::uint64_t id) const {
  return dir_ / fmt::format("{}{:020}", window_prefix, id);
}

void durable_store::write_window(std::uint64_t id, std::span<const blob_view> blobs) {
  std::vector<const blob_view*> sorted;
  for (const auto& b : blobs) {
    if (!valid_blob_name(b.name)) {
      throw std::invalid_argument(fmt::format(
          "blob name '{}' is not allowed (use [A-Za-z0-9._-], at most 128, no leading '.')",
          b.name));
    }
    sorted.push_back(&b);
  }
  std::sort(sorted.begin(), sorted.end(),
            [](const blob_view* a, const blob_view* b) { return a->name < b->name; });
  for (std::size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i]->name == sorted[i - 1]->name) {
      throw std::invalid_argument(fmt::format("blob name '{}' appears twice", sorted[i]->name));
    }
  }
  const auto wdir = window_dir(id);
  std::error_code ec;
  // Never write through a link: a window-* symlink (not ours) is removed, its target untouched.
  if (std::filesystem::is_symlink(std::filesystem::symlink_status(wdir, ec))) {
    std::filesystem::remove(wdir, ec);
  }
  if (!std::filesystem::exists(wdir, ec)) {
    write_into(wdir, id, sorted);
    return;
  }
  // Rewriting a window: the new one is written whole beside it, then the two directories are
  // exchanged in one step, so that a failure or a kill at any moment leaves one of them whole
  // under the window's name (dropping the old manifest first lost the window to a failed
  // rewrite).
  const auto staging = staging_dir(id);
  std::filesystem::remove_all(staging, ec);
  write_into(staging, id, sorted);
  if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, wdir.c_str(), RENAME_EXCHANGE) == 0) {
    sync_directory(dir_);
    std::filesystem::remove_all(staging, ec);  // the old window, once exchanged
    return;
  }
  const int err = errno;
  if (err != EINVAL && err != ENOSYS && err != EOPNOTSUPP) {
    std::filesystem::remove_all(staging, ec);
    throw std::runtime_error(fmt::format("cannot put the rewritten window {} in place: {}",
                                         wdir.string(), std::strerror(err)));
  }
  // No exchange on this file system (NFS): the old window steps aside, the new one takes its
  // name, then the old one goes. A kill between the two renames leaves both whole beside an
  // empty name, and the next prune() puts the new one back (settle_rewrites).
  const auto aside = aside_dir(id);
  std::filesystem::remove_all(aside, ec);
  std::filesystem::rename(wdir, aside);
  std::filesystem::rename(staging, wdir);
  sync_directory(dir_);
  std::filesystem::remove_all(aside, ec);
}

void durable_store::settle_rewrites() {
  std::error_code ec;
  std::vector<std::filesystem::path> leftovers;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    if (is_staging(entry.path().filename().string())) leftovers.push_back(entry.path());
  }
  // The newer first: a new window still beside an empty name goes back before an old one.
  std::sort(leftovers.begin(), leftovers.end(), [](const auto& a, const auto& b) {
    return a.extension() == staging_suffix && b.extension() != staging_suffix;
  });
  for (const auto& p : leftovers) {
    const auto name = p.parent_path() / p.stem();  // window-<id>
    if (!std::filesystem::exists(name, ec) && std::filesystem::exists(p / manifest_name, ec)) {
      std::filesystem::rename(p, name, ec);
      if (!ec) continue;
    }
    std::filesystem::remove_all(p, ec);
  }
}

void durable_store::write_into(const std::filesystem::path& wdir, std::uint64_t id,
                               const std::vector<const blob_view*>& sorted) {
  std::error_code ec;
  create_private_directories(wdir);
  try {
    std::string body = fmt::format("moevement-durable-window {}\nwindow {}\n", format_version, id);
    for (const blob_view* b : sorted) {
      write_file_atomically(wdir / b->name, b->bytes);
      body += fmt::format("blob {} {} {}\n", b->name, b->bytes.size(), hex16(xxhash64(b->bytes)));
    }
    const std::string manifest = body + "manifest-xxh64 " + hex16(xxhash64(as_bytes(body))) + "\n";
    write_file_atomically(wdir / manifest_name, as_bytes(manifest));
  } catch (...) {
    // A failed write leaves no half window (and no empty directory) behind.
    std::filesystem::remove_all(wdir, ec);
    throw;
  }
}

std::filesystem::path durable_store::staging_dir(std::uint64_t id) const {
  return dir_ / fmt::format("{}{:020}{}", window_prefix, id, staging_suffix);
}

std::filesystem::path durable_store::aside_dir(std::uint64_t id) const {
  return dir_ / fmt::format("{}{:020}{}", window_prefix, id, aside_suffix);
}

result<loaded_window> durable_store::load(std::uint64_t id) const {
  const auto wdir = window_dir(id);
  const auto mpath = wdir / manifest_name;
  std::error_code ec;
  const auto msize = std::filesystem::file_size(mpath, ec);
  if (ec) return error{fmt::format("window {}: no manifest ({})", id, ec.message())};
  if (msize > max_manifest_bytes) {
    return error{fmt::format("window {}: manifest of {} bytes is too large", id, msize)};
  }
  auto mbytes = read_whole_file(mpath);
  if (!mbytes.ok()) return error{fmt::format("window {}: {}", id, mbytes.err().message)};
  const std::string text(reinterpret_cast<const char*>(mbytes->data()), mbytes->size());
  auto entries = parse_manifest(text, id);
  if (!entries.ok()) return error{fmt::format("window {}: {}", id, entries.err().message)};

  loaded_window w;
  w.id = id;
  for (const auto& e : *entries) {
    const auto path = wdir / e.name;
    const auto size = std::filesystem::file_size(path, ec);
    if (ec) return error{fmt::format("window {}: blob {}: missing ({})", id, e.name, ec.message())};
    if (size != e.bytes) {
      return error{
          fmt::format("window {}: blob {}: {} bytes on disk, manifest says {} "
                      "(truncated or torn)",
                      id, e.name, size, e.bytes)};
    }
    auto bytes = read_whole_file(path);
    if (!bytes.ok()) return error{fmt::format("window {}: {}", id, bytes.err().message)};
    if (xxhash64(*bytes) != e.hash) {
      return error{fmt::format("window {}: blob {}: checksum mismatch (corrupt)", id, e.name)};
    }
    w.blobs.emplace(e.name, std::move(*bytes));
  }
  return w;
}

std::vector<std::uint64_t> durable_store::windows() const {
  auto ids = listed_windows();
  if (!ids.ok()) throw std::runtime_error(ids.err().message);
  return std::move(*ids);
}

result<std::vector<std::uint64_t>> durable_store::listed_windows() const {
  std::vector<std::uint64_t> ids;
  std::error_code ec;
  std::filesystem::directory_iterator listing(dir_, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) {
    // Not "no windows": a resume or requeue would start the job over and clear them.
    return error{fmt::format(
        "cannot list the durable windows in {}: {} (check that it is a directory this user "
        "can read, and that its file system is mounted)",
        dir_.string(), ec.message())};
  }
  for (const auto& entry : listing) {
    const std::string name = entry.path().filename().string();
    std::uint64_t id = 0;
    if (name.rfind(window_prefix, 0) != 0 || !parse_int(name.substr(7), id)) continue;
    if (entry.is_symlink(ec)) continue;  // not a window this job wrote: never read through it
    if (std::filesystem::exists(entry.path() / manifest_name)) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

result<loaded_window> durable_store::load_latest(std::vector<std::string>* rejected) const {
  const auto ids = windows();
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    auto w = load(*it);
    if (w.ok()) return w;
    if (rejected != nullptr) rejected->push_back(w.err().message);
  }
  return error{
      fmt::format("no complete, verified checkpoint window in {} ({} candidate(s) "
                  "rejected)",
                  dir_.string(), ids.size())};
}

void durable_store::prune(std::size_t keep, const std::set<std::uint64_t>& also) {
  settle_rewrites();
  const auto listed = listed_windows();
  // (Nothing listed, nothing removed: the next write's prune tries again.)
  if (!listed.ok() || listed->empty()) return;
  const auto& ids = *listed;
  const std::size_t drop = ids.size() > keep ? ids.size() - keep : 0;
  for (std::size_t i = 0; i < drop; ++i) {
    if (also.contains(ids[i])) continue;
    // The manifest first: a removal cut short (a kill) leaves an unfinished write, which a
    // later scan skips, not a window with files missing, which it would report as rejected.
    std::error_code ec;
    std::filesystem::remove(window_dir(ids[i]) / manifest_name, ec);
    std::filesystem::remove_all(window_dir(ids[i]));
  }
  const std::uint64_t newest = ids.back();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    std::uint64_t id = 0;
    if (name.rfind(window_prefix, 0) != 0 || !parse_int(name.substr(7), id)) continue;
    if (id < newest && !std::filesystem::exists(entry.path() / manifest_name)) {
      std::filesystem::remove_all(entry.path());
    }
  }
}

void durable_store::drop_after(std::uint64_t id) {
  std::error_code ec;
  std::vector<std::filesystem::path> drop;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    std::uint64_t w = 0;
    if (name.rfind(window_prefix, 0) != 0 || !parse_int(name.substr(7), w)) continue;
    if (w > id) drop.push_back(entry.path());
  }
  for (const auto& p : drop) std::filesystem::remove_all(p, ec);
}

void durable_store::clear() {
  std::error_code ec;
  std::vector<std::filesystem::path> drop;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    std::uint64_t w = 0;
    if ((name.rfind(window_prefix, 0) == 0 && parse_int(name.substr(7), w)) || is_staging(name)) {
      drop.push_back(entry.path());
    }
  }
  for (const auto& p : drop) std::filesystem::remove_all(p, ec);
}

}  // namespace moevement::recovery
