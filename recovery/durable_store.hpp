// The durable tier: persisted checkpoint windows on disk, written so that a crash at any
// moment leaves the previous good window loadable, and read so that a corrupt, truncated or
// torn window is rejected with a reason and the one before it is used instead.
//
// Layout under the store's directory:
//   window-<id, 20 digits>/<blob name>   one file per blob, written atomically
//   window-<id, 20 digits>/MANIFEST      written last, atomically: the window exists only
//                                        once its manifest does
// MANIFEST is text:
//   moevement-durable-window 1
//   window <id>
//   blob <name> <bytes> <xxh64, 16 hex>     (one line per blob, sorted by name)
//   manifest-xxh64 <xxh64 of all the lines above, 16 hex>
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "base/result.hpp"

namespace moevement::recovery {

struct blob_view {
  std::string name;  // [A-Za-z0-9._-]+, at most 128 characters, not starting with '.'
  std::span<const std::byte> bytes;
};

struct loaded_window {
  std::uint64_t id = 0;
  std::map<std::string, std::vector<std::byte>> blobs;
};

class durable_store {
 public:
  static constexpr int format_version = 1;

  // Creates the directory if needed; throws naming it if that fails.
  explicit durable_store(std::filesystem::path dir);

  // Writes every blob, then the manifest. Throws (naming the file) on an I/O error; the
  // store then still holds every window it held before (a window rewritten included: the
  // new one is written beside it and exchanged for it in one rename).
  void write_window(std::uint64_t id, std::span<const blob_view> blobs);

  // The newest window that verifies completely. Windows that fail are skipped; each reason
  // ("window 12: blob stage-1.bin: checksum mismatch ...") is appended to *rejected.
  result<loaded_window> load_latest(std::vector<std::string>* rejected = nullptr) const;

  // Verifies and loads one window.
  result<loaded_window> load(std::uint64_t id) const;

  // Window ids present on disk with a manifest, ascending (not verified). None where the
  // directory does not exist; throws (naming it) where it exists but cannot be listed.
  std::vector<std::uint64_t> windows() const;
  // The same, or why the directory cannot be listed.
  result<std::vector<std::uint64_t>> listed_windows() const;

  // Deletes all but the newest `keep` windows that have a manifest (and those in `also`), and
  // any window directory without a manifest older than the newest complete one (a torn write).
  // First, what a rewrite cut short left beside its window is settled (settle_rewrites).
  void prune(std::size_t keep, const std::set<std::uint64_t>& also = {});

  // Deletes every window newer than `id`, complete or not (a global rollback to `id`
  // abandons them: they must not outrank the windows written after it).
  void drop_after(std::uint64_t id);

  // Deletes every window, complete or not (a new job must never load an older job's).
  void clear();

  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path window_dir(std::uint64_t id) const;
  std::filesystem::path staging_dir(std::uint64_t id) const;
  std::filesystem::path aside_dir(std::uint64_t id) const;
  // What rewrites left beside their windows: a whole one whose window name is empty goes back
  // under it (the new before the old), the rest is removed.
  void settle_rewrites();
  // The blobs (sorted by name), then the manifest, into `wdir`; nothing left there on failure.
  static void write_into(const std::filesystem::path& wdir, std::uint64_t id,
                         const std::vector<const blob_view*>& sorted);
  std::filesystem::path dir_;
};

// True when name is a safe blob name (see blob_view).
bool valid_blob_name(const std::string& name);

}  // namespace moevement::recovery
