#include "recovery/dense_capture.hpp"
#include "base/clock.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace moevement::recovery {
namespace {

using clock_type = std::chrono::steady_clock;

void require_interval(int interval) {
  if (interval < 1) {
    throw std::invalid_argument(
        fmt::format("dense capture: interval {} must be >= 1 (resolve checkpoint.interval = 0 with "
                    "resolve_interval first)",
                    interval));
  }
}

}  // namespace

int young_interval(double snapshot_seconds, double mtbf_seconds, double iteration_seconds) {
  if (!std::isfinite(snapshot_seconds) || snapshot_seconds < 0) {
    throw std::invalid_argument("young_interval: snapshot cost must be finite and >= 0 seconds");
  }
  if (!std::isfinite(mtbf_seconds) || mtbf_seconds <= 0) {
    throw std::invalid_argument("young_interval: MTBF must be finite and > 0 seconds");
  }
  if (!std::isfinite(iteration_seconds) || iteration_seconds <= 0) {
    throw std::invalid_argument("young_interval: iteration time must be finite and > 0 seconds");
  }
  const double k = std::round(std::sqrt(2.0 * snapshot_seconds * mtbf_seconds) / iteration_seconds);
  // an interval beyond 2^30 iterations never comes; clamp before the conversion
  return int(std::clamp(k, 1.0, double(1 << 30)));
}

double expected_overhead(int k, double snapshot_seconds, double mtbf_seconds,
                         double iteration_seconds) {
  const double tau = double(k) * iteration_seconds;
  return snapshot_seconds / tau + tau / (2.0 * mtbf_seconds);
}

int resolve_interval(const policy_config& config, double snapshot_seconds,
                     double iteration_seconds) {
  config.validate();
  if (config.interval > 0) return config.interval;
  return young_interval(snapshot_seconds, config.mtbf_s, iteration_seconds);
}

double measure_snapshot_seconds(std::span<models::operator_state* const> ops, int repeats) {
  const std::vector<const models::operator_state*> cops(ops.begin(), ops.end());
  const std::vector<capture_kind> kinds(ops.size(), capture_kind::full);
  std::vector<std::byte> scratch(snapshot_size(cops, kinds));
  double best = std::numeric_limits<double>::infinity();
  for (int r = 0; r < std::max(repeats, 1); ++r) {
    const auto t0 = clock_type::now();
    write_snapshot(scratch, {}, models::loss_scaler{}, cops, kinds);
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

std::filesystem::path replica_dir(const std::filesystem::path& dir, int stage, int replica) {
  return dir / fmt::format("stage-{}-replica-{}", stage, replica);
}

dense_capture::dense_capture(int stage, int replica, int interval,
                             const models::loss_scaler* scaler)
    : stage_(stage), replica_(replica), interval_(interval), scaler_(scaler) {
  require_interval(interval);
}

dense_capture::dense_capture(int stage, int replica, int interval,
                             const models::loss_scaler* scaler, const std::filesystem::path& dir,
                             int keep)
    : dense_capture(stage, replica, interval, scaler) {
  if (keep < 2) {
    throw std::invalid_argument(
        "checkpoint.keep: must be >= 2 (a corrupt newest snapshot needs "
        "a previous good one)");
  }
  keep_ = std::size_t(keep);
  store_.emplace(replica_dir(dir, stage, replica));
  thread_ = std::thread([this] { persist_loop(); });
}

dense_capture::~dense_capture() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void dense_capture::set_interval(int interval) {
  require_interval(interval);
  interval_ = interval;
}

void dense_capture::after_step(std::int64_t iteration,
                               std::span<models::operator_state* const> ops) {
  rethrow_persist_error();
  if ((iteration + 1) % interval_ != 0) return;
  // the buffer that does not hold the newest complete snapshot
  const int target = newest_ < 0 ? 0 : 1 - newest_;
  buffer& buf = bufs_[target];
  if (store_) {
    std::unique_lock lock(mu_);
    last_stall_s_ = 0;
    if (buf.persisting) {
      const auto t0 = clock_type::now();
      cv_.wait(lock, [&] { return !buf.persisting; });
      last_stall_s_ = seconds_since(t0);
      stall_s_ += last_stall_s_;
      ++stalls_;
    }
  }
  rethrow_persist_error();
  const auto t0 = clock_type::now();
  const std::vector<const models::operator_state*> cops(ops.begin(), ops.end());
  kinds_.assign(ops.size(), capture_kind::full);
  buf.iteration = -1;  // in flight
  // same operators every time: same size, the buffer is reused without allocating
  buf.bytes.resize(snapshot_size(cops, kinds_));
  const models::loss_scaler scaler = scaler_ ? *scaler_ : models::loss_scaler{};
  const std::int64_t state_iteration = iteration + 1;
  write_snapshot(buf.bytes,
                 {std::uint64_t(state_iteration / interval_), 0, state_iteration, stage_, replica_},
                 scaler, cops, kinds_);
  buf.iteration = state_iteration;
  newest_ = target;
  last_snapshot_s_ = seconds_since(t0);
  snapshot_bytes_ = buf.bytes.size();
  ++snapshots_;
  if (store_) {
    {
      std::lock_guard lock(mu_);
      buf.persisting = true;
      queue_.push_back(target);
    }
    cv_.notify_all();
  }
}

void dense_capture::persist_loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left to write
    const int index = queue_.front();
    buffer& buf = bufs_[index];
    const std::int64_t iteration = buf.iteration;
    const std::span<const std::byte> bytes = buf.bytes;
    lock.unlock();
    // The compute thread does not touch a buffer while it is persisting.
    const auto t0 = clock_type::now();
    std::exception_ptr error;
    try {
      const blob_view blob{"snapshot", bytes};
      store_->write_window(std::uint64_t(iteration), std::span(&blob, 1));
      store_->prune(keep_);
    } catch (const std::exception& e) {
      error = std::make_exception_ptr(std::runtime_error(
          fmt::format("dense-disk: persisting stage {} replica {} iteration {} to {} failed: {} "
                      "(check the disk and checkpoint.dir)",
                      stage_, replica_, iteration, store_->dir().string(), e.what())));
    }
    const double took = seconds_since(t0);
    lock.lock();
    queue_.pop_front();
    buf.persisting = false;
    last_persist_s_ = took;
    if (error) {
      if (!persist_error_) persist_error_ = error;
    } else {
      ++persisted_;
    }
    cv_.notify_all();
  }
}

void dense_capture::rethrow_persist_error() {
  if (!store_) return;
  std::exception_ptr e;
  {
    std::lock_guard lock(mu_);
    e = persist_error_;
  }
  if (e) std::rethrow_exception(e);
}

void dense_capture::flush() {
  if (!store_) return;
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return queue_.empty(); });
  }
  rethrow_persist_error();
}

std::vector<dense_snapshot> dense_capture::held() const {
  std::vector<dense_snapshot> out;
  if (newest_ < 0) return out;
  for (int i : {newest_, 1 - newest_}) {
    const buffer& b = bufs_[i];
    if (b.iteration >= 0) out.push_back({b.iteration, b.bytes});
  }
  return out;
}

std::optional<dense_snapshot> dense_capture::latest() const {
  auto h = held();
  if (h.empty()) return std::nullopt;
  return h.front();
}

std::uint64_t dense_capture::persisted() const {
  std::lock_guard lock(mu_);
  return persisted_;
}

double dense_capture::last_persist_seconds() const {
  std::lock_guard lock(mu_);
  return last_persist_s_;
}

}  // namespace moevement::recovery
