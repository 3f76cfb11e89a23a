// Policy moevement's windows in the durable tier (docs/sparse-checkpointing.md "Durable
// tier"): one durable_store per stage replica, under checkpoint.dir/stage-<s>-replica-<d>/,
// one store window per persisted sparse window, holding
//   slot-<j, 6 digits>.snap   slot j's snapshot bytes, exactly as captured and replicated
//                             (self-describing: tag, loss scaler, operators; own checksum)
//   window.meta               text: what the conversion needs beside the slots
//     moevement-window 1
//     stage <s>
//     replica <d>
//     window <id>
//     first_iteration <w0>    the first iteration a conversion from it replays
//     w_sparse <W>            slots in the window
// The step plans of w0 .. t-1 are the same on every stage and come from the coordinator
// (it keeps them back to the oldest durable window it asked for).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "base/result.hpp"
#include "recovery/durable_store.hpp"

namespace moevement::recovery {

struct durable_window_meta {
  int stage = 0, replica = 0;
  std::uint64_t window = 0;
  std::int64_t first_iteration = 0;
  int w_sparse = 0;
  bool operator==(const durable_window_meta&) const = default;
};

struct durable_window {
  durable_window_meta meta;
  std::vector<std::vector<std::byte>> slots;  // [slot]
};

inline constexpr int durable_window_format = 1;

// checkpoint.dir/stage-<s>-replica-<d>/
std::filesystem::path durable_window_dir(const std::filesystem::path& root, int stage, int replica);

// Writes the window (meta.w_sparse slots) atomically; returns the bytes written. Throws naming
// the file on an I/O error (the store then still holds every window it held before).
std::uint64_t write_durable_window(durable_store& store, const durable_window_meta& meta,
                                   std::span<const std::span<const std::byte>> slots);

// Loads and verifies window `id` of (stage, replica): the store's manifest and checksums, the
// meta (its stage, replica and window), and every slot (its own checksum and tag). The error
// says which window and what is wrong.
result<durable_window> load_durable_window(const durable_store& store, std::uint64_t id, int stage,
                                           int replica);

// The windows of the store that load_durable_window accepts, ascending; the reason of every
// other one is appended to *rejected.
std::vector<std::uint64_t> verified_durable_windows(const durable_store& store, int stage,
                                                    int replica,
                                                    std::vector<std::string>* rejected);

// The durable tier's writer thread of a worker process: jobs run one after the other, off the
// training and actor threads. Outlives a stage (a restore replaces the stage, not the writer).
class durable_writer {
 public:
  durable_writer();
  ~durable_writer();  // finishes the jobs posted, then joins
  durable_writer(const durable_writer&) = delete;
  durable_writer& operator=(const durable_writer&) = delete;

  void post(std::function<void()> job);
  // Blocks until every job posted before has run (a reader then sees a stable directory).
  void drain();

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false, stop_ = false;
  std::thread thread_;  // last: started once the rest is built
};

}  // namespace moevement::recovery
