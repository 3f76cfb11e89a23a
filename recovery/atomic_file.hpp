// Durable-tier file writes: temp file in the same directory, write, fsync, rename over the
// target, fsync the directory. A crash at any point leaves either the old file or the new
// one, never a torn mix under the target name. Training state is private: files are 0600
// and the directories made here 0700, whatever the umask.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <vector>

#include "base/result.hpp"

namespace moevement::recovery {

// Throws with the path and the reason if any step fails; the target is then untouched.
void write_file_atomically(const std::filesystem::path& target, std::span<const std::byte> bytes);
// Makes the entries of `dir` (renames, removals) durable. Throws naming it on an error.
void sync_directory(const std::filesystem::path& dir);

result<std::vector<std::byte>> read_whole_file(const std::filesystem::path& path);

// Creates `dir` and any missing parents, each 0700 whatever the umask; directories that
// already exist are left as they are. Throws with the path and the reason.
void create_private_directories(const std::filesystem::path& dir);

}  // namespace moevement::recovery
