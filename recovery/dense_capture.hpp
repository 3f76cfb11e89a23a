// The dense baselines' capture (docs/policies.md): every k iterations a full snapshot of one
// stage replica (every operator `full` in the snapshot.hpp format, plus the loss scaler) into
// a reused host buffer. Two buffers: the newest complete snapshot and the one being written.
//   dense-memory (Gemini-like): the snapshot stays in host memory (the actor engine ships it
//     to peers' host memory).
//   dense-disk (CheckFreq-like): the snapshot is then persisted in the background, on this
//     capture's own thread, through a durable_store under dir/stage-<s>-replica-<d>/ (one
//     window per snapshot, id = its state iteration, one blob "snapshot"). A snapshot that
//     would overwrite a buffer whose persist is still running waits for it: that wait is the
//     stall of the next optimizer step, measured and exposed.
// Snapshot points: after the step of iteration i when (i + 1) % k == 0; the snapshot holds the
// state at the start of iteration i + 1 (a multiple of k). Every stage must use the same k so
// that a global rollback finds one iteration snapshotted everywhere.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <filesystem>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "engine/hooks.hpp"
#include "recovery/durable_store.hpp"
#include "recovery/policy_config.hpp"
#include "recovery/snapshot.hpp"

namespace moevement::recovery {

// Young's optimum checkpoint interval in iterations: round(sqrt(2 * C * MTBF) / T), at least
// 1: the integer k near the minimum of expected_overhead. C: seconds one snapshot costs the
// training, T: seconds per iteration. Throws std::invalid_argument for C < 0, MTBF <= 0,
// T <= 0 or non-finite inputs.
int young_interval(double snapshot_seconds, double mtbf_seconds, double iteration_seconds);

// Young's first-order expected overhead (fraction of wall time) with a checkpoint every k
// iterations: C / (k T) for taking checkpoints plus k T / (2 MTBF) for the work a failure
// loses on average (half an interval).
double expected_overhead(int k, double snapshot_seconds, double mtbf_seconds,
                         double iteration_seconds);

// config.interval when > 0, else young_interval(C, config.mtbf_s, T). Use the largest C of all
// stages (they snapshot in parallel; the slowest sets the cost) and agree k job-wide.
int resolve_interval(const policy_config& config, double snapshot_seconds,
                     double iteration_seconds);

// Seconds to write one full snapshot of ops (the best of `repeats` runs into a scratch
// buffer): Young's C for this stage.
double measure_snapshot_seconds(std::span<models::operator_state* const> ops, int repeats = 3);

// Where dense-disk persists stage s replica d under the configured directory.
std::filesystem::path replica_dir(const std::filesystem::path& dir, int stage, int replica);

// A complete snapshot in host memory (bytes valid until the capture's next after_step).
struct dense_snapshot {
  std::int64_t iteration = 0;  // state at the start of this iteration
  std::span<const std::byte> bytes;
};

class dense_capture : public engine::stage_hooks {
 public:
  // dense-memory. interval >= 1 (resolve 0 with resolve_interval first). scaler: the job's
  // loss scaler, read at each snapshot (nullptr: recorded as disabled with scale 1).
  dense_capture(int stage, int replica, int interval, const models::loss_scaler* scaler);
  // dense-disk: also persists every snapshot under replica_dir(dir, stage, replica), keeping
  // the newest `keep` (>= 2) windows there. Throws when the directory cannot be created.
  dense_capture(int stage, int replica, int interval, const models::loss_scaler* scaler,
                const std::filesystem::path& dir, int keep);
  // Waits for the persist in flight (a clean shutdown loses no snapshot); errors are dropped
  // here: call flush() first to see them.
  ~dense_capture() override;
  dense_capture(const dense_capture&) = delete;
  dense_capture& operator=(const dense_capture&) = delete;

  void after_step(std::int64_t iteration, std::span<models::operator_state* const> ops) override;

  int stage() const { return stage_; }
  int replica() const { return replica_; }
  int interval() const { return interval_; }
  // Changes k from the next snapshot point on (e.g. Young's k re-derived from measured C).
  void set_interval(int interval);
  bool persists() const { return store_.has_value(); }

  // Complete snapshots held in host memory, newest first (at most two).
  std::vector<dense_snapshot> held() const;
  std::optional<dense_snapshot> latest() const;

  // Waits until every queued persist is on disk; rethrows the first persist error (with the
  // directory and iteration in its message).
  void flush();

  // ---- measurements (compute thread; persist figures once flushed)
  std::uint64_t snapshots() const { return snapshots_; }
  double last_snapshot_seconds() const { return last_snapshot_s_; }
  std::size_t snapshot_bytes() const { return snapshot_bytes_; }
  // Time after_step waited for a persist of the buffer it was about to overwrite.
  double last_stall_seconds() const { return last_stall_s_; }
  double stall_seconds() const { return stall_s_; }
  std::uint64_t stalls() const { return stalls_; }
  std::uint64_t persisted() const;
  double last_persist_seconds() const;
  std::size_t bytes_held() const { return bufs_[0].bytes.capacity() + bufs_[1].bytes.capacity(); }

 private:
  struct buffer {
    std::vector<std::byte> bytes;
    std::int64_t iteration = -1;  // -1: nothing complete in it
    bool persisting = false;      // queued or being written (guarded by mu_)
  };
  void persist_loop();
  void rethrow_persist_error();

  int stage_, replica_, interval_;
  const models::loss_scaler* scaler_;
  buffer bufs_[2];
  int newest_ = -1;
  std::vector<capture_kind> kinds_;
  std::uint64_t snapshots_ = 0, stalls_ = 0;
  double last_snapshot_s_ = 0, last_stall_s_ = 0, stall_s_ = 0;
  std::size_t snapshot_bytes_ = 0;

  // dense-disk only
  std::optional<durable_store> store_;
  std::size_t keep_ = 2;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> queue_;  // buffer indices to persist, in order
  bool stop_ = false;
  std::exception_ptr persist_error_;
  std::uint64_t persisted_ = 0;
  double last_persist_s_ = 0;
  std::thread thread_;  // last: started once everything above exists
};

}  // namespace moevement::recovery
