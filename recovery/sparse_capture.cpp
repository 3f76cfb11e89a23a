#include "recovery/sparse_capture.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include "recovery/policy_limits.hpp"

namespace moevement::recovery {

const char* ordering_name(ordering o) {
  switch (o) {
    case ordering::popularity:
      return "popularity";
    case ordering::soft_count:
      return "soft-count";
    case ordering::time_decayed:
      return "time-decayed";
    case ordering::capacity_aware:
      return "capacity-aware";
  }
  return "?";
}

ordering parse_ordering(const std::string& name) {
  for (auto o : {ordering::popularity, ordering::soft_count, ordering::time_decayed,
                 ordering::capacity_aware}) {
    if (name == ordering_name(o)) return o;
  }
  throw std::invalid_argument("unknown ordering '" + name +
                              "' (popularity, soft-count, time-decayed or capacity-aware)");
}

sim::sparse_op sparse_sizes(const models::operator_state& op) {
  sim::sparse_op s;
  const auto floats = std::uint64_t(op.numel()) * sizeof(float);
  s.compute_bytes = op.compute_bytes().size();
  s.master_bytes = floats;
  s.optim_bytes = 2 * floats;
  return s;
}

int find_w_sparse(std::span<const std::vector<models::operator_state*>> stages,
                  double iteration_seconds, double bandwidth_bytes_per_s) {
  int w = 1;
  for (const auto& ops : stages) {
    std::vector<sim::sparse_op> sizes;
    for (const auto* op : ops) sizes.push_back(sparse_sizes(*op));
    w = std::max(w,
                 sim::find_window_size(sizes, iteration_seconds, bandwidth_bytes_per_s).w_sparse);
  }
  return w;
}

stage_schedule::stage_schedule(const sparse_config& config,
                               std::span<models::operator_state* const> ops)
    : config_(config), n_(ops.size()) {
  if (n_ == 0) throw std::invalid_argument("sparse schedule: the stage has no operators");
  if (!config.capacities.empty() && config.capacities.size() != n_) {
    throw std::invalid_argument("sparse schedule: capacities for " +
                                std::to_string(config.capacities.size()) + " operators of " +
                                std::to_string(n_));
  }
  for (double c : config.capacities) {
    if (!(c > 0)) throw std::invalid_argument("sparse schedule: capacities must be > 0");
  }
  if (!(config.decay_alpha >= 0 && config.decay_alpha < 1)) {
    throw std::invalid_argument("sparse schedule: decay_alpha must be in [0, 1)");
  }
  if (config.w_sparse < 0) throw std::invalid_argument("sparse schedule: w_sparse must be >= 0");
  if (config.w_sparse > 0) {
    w_ = config.w_sparse;
  } else {
    if (config.iteration_seconds <= 0 || config.bandwidth_bytes_per_s <= 0) {
      throw std::invalid_argument(
          "sparse schedule: w_sparse = 0 needs the profiled iteration time and snapshot "
          "bandwidth (both > 0)");
    }
    const std::vector<models::operator_state*> all(ops.begin(), ops.end());
    w_ = find_w_sparse(std::span(&all, 1), config.iteration_seconds, config.bandwidth_bytes_per_s);
  }
  o_active_ = int((n_ + std::size_t(w_) - 1) / std::size_t(w_));
  for (const auto* op : ops) is_expert_.push_back(op->kind() == models::op_kind::expert);
  // Before any count: experts (popularity 0) first, then the rest, each in index order.
  std::vector<sim::sparse_op> pop(n_);
  for (std::size_t i = 0; i < n_; ++i) {
    pop[i].popularity = is_expert_[i] ? 0.0 : std::numeric_limits<double>::max();
  }
  order_ = sim::order_by_popularity(pop);
}

void stage_schedule::add_popularity(std::int64_t iteration,
                                    std::span<models::operator_state* const> ops,
                                    std::optional<std::uint64_t> window) {
  if (ops.size() != n_) throw std::invalid_argument("sparse schedule: operator count changed");
  // A gate's counters are per expert of its layer: the next routed_tokens().size() experts.
  std::vector<double> c(n_, 0.0);
  for (std::size_t i = 0; i < n_; ++i) {
    if (ops[i]->kind() != models::op_kind::gate) continue;
    const auto& routed = ops[i]->routed_tokens();
    const auto& probs = ops[i]->prob_sums();
    std::size_t e = 0;
    for (std::size_t j = i + 1; j < n_ && e < routed.size(); ++j) {
      if (!is_expert_[j]) continue;
      c[j] = config_.soft() ? (e < probs.size() ? probs[e] : 0.0) : double(routed[e]);
      ++e;
    }
  }
  add_counts(iteration, c, window);
}

void stage_schedule::add_counts(std::int64_t iteration, std::span<const double> counts,
                                std::optional<std::uint64_t> window) {
  if (counts.size() != n_) throw std::invalid_argument("sparse schedule: operator count changed");
  const std::uint64_t win = window.value_or(std::uint64_t(iteration) / std::uint64_t(w_));
  auto& c = counts_[win];
  c.resize(n_, 0.0);
  if (config_.order_by == ordering::time_decayed) {
    // One step of the moving average per iteration (a mini-batch), over every replica's
    // counts of it: they are gathered until the next iteration (or a schedule) folds them in.
    if (iteration != pending_iteration_) fold_pending();
    pending_iteration_ = iteration;
    pending_window_ = win;
    pending_.resize(n_, 0.0);
    for (std::size_t i = 0; i < n_; ++i) {
      if (is_expert_[i]) pending_[i] += counts[i];
    }
    return;
  }
  for (std::size_t i = 0; i < n_; ++i) {
    if (!is_expert_[i]) continue;
    c[i] += config_.order_by == ordering::capacity_aware && !config_.capacities.empty()
                ? sim::capacity_normalized_popularity(counts[i], config_.capacities[i])
                : counts[i];
  }
}

void stage_schedule::fold_pending() {
  if (pending_iteration_ < 0) return;
  decayed_.resize(n_, 0.0);
  auto& c = counts_[pending_window_];
  c.assign(n_, 0.0);  // the window's popularity: the moving average as of its last iteration
  for (std::size_t i = 0; i < n_; ++i) {
    if (!is_expert_[i]) continue;
    decayed_[i] = sim::time_decayed_popularity(decayed_[i], pending_[i], config_.decay_alpha);
    c[i] = decayed_[i];
  }
  pending_iteration_ = -1;
  pending_.assign(n_, 0.0);
}

const std::vector<sim::schedule_slot>& stage_schedule::window_schedule(std::uint64_t window,
                                                                       int w) {
  if (auto it = schedules_.find(window); it != schedules_.end()) return it->second;
  if (w <= 0) w = w_;
  fold_pending();
  if (window > 0) {
    if (auto it = counts_.find(window - 1); it != counts_.end()) {
      std::vector<double> experts;
      for (std::size_t i = 0; i < n_; ++i) {
        if (is_expert_[i]) experts.push_back(it->second[i]);
      }
      if (order_popularity_.empty() ||
          sim::should_reorder(order_popularity_, experts, config_.reorder)) {
        std::vector<sim::sparse_op> pop(n_);
        for (std::size_t i = 0; i < n_; ++i) {
          pop[i].popularity = is_expert_[i] ? it->second[i] : std::numeric_limits<double>::max();
        }
        const auto order = sim::order_by_popularity(pop);
        if (order != order_) ++reorders_;
        order_ = order;
        order_popularity_ = std::move(experts);
      }
    }
  }
  // Counts and schedules older than the window before are of no further use.
  counts_.erase(counts_.begin(), counts_.lower_bound(window == 0 ? 0 : window - 1));
  schedules_.erase(schedules_.begin(), schedules_.lower_bound(window == 0 ? 0 : window - 1));
  const int o_active = int((n_ + std::size_t(w) - 1) / std::size_t(w));
  return schedules_[window] = sim::generate_schedule(order_, w, o_active);
}

void stage_schedule::load(state s) {
  const auto bad = [](const std::string& what) {
    throw std::invalid_argument("sparse schedule state: " + what);
  };
  if (s.order.size() != n_) bad("an order of " + std::to_string(s.order.size()) + " operators");
  std::vector<bool> seen(n_, false);
  for (std::size_t i : s.order) {
    if (i >= n_ || seen[i]) bad("the order is not a permutation of the operators");
    seen[i] = true;
  }
  std::size_t experts = 0;
  for (bool e : is_expert_) experts += e ? 1 : 0;
  if (!s.order_popularity.empty() && s.order_popularity.size() != experts) {
    bad("popularity of " + std::to_string(s.order_popularity.size()) + " experts");
  }
  for (const auto& [w, c] : s.counts) {
    if (c.size() != n_) bad("counts of window " + std::to_string(w) + " do not fit");
  }
  for (const auto& [w, slots] : s.schedules) {
    if (slots.empty() || slots.size() > (std::size_t(1) << 20))
      bad("a schedule of " + std::to_string(slots.size()) + " slots");
    for (const auto& sl : slots) {
      for (std::size_t i : sl.active) {
        if (i >= n_) bad("a schedule names operator " + std::to_string(i));
      }
      for (std::size_t i : sl.frozen) {
        if (i >= n_) bad("a schedule names operator " + std::to_string(i));
      }
    }
  }
  if (!s.decayed.empty() && s.decayed.size() != n_) bad("a moving average that does not fit");
  if (!s.pending.empty() && s.pending.size() != n_) bad("pending counts that do not fit");
  order_ = std::move(s.order);
  order_popularity_ = std::move(s.order_popularity);
  decayed_ = std::move(s.decayed);
  pending_ = std::move(s.pending);
  pending_iteration_ = s.pending_iteration;
  pending_window_ = s.pending_window;
  counts_ = std::move(s.counts);
  schedules_ = std::move(s.schedules);
  reorders_ = s.reorders;
}

sparse_capture::sparse_capture(stage_schedule& schedule, int stage, int replica,
                               const models::loss_scaler* scaler)
    : schedule_(&schedule), stage_(stage), replica_(replica), scaler_(scaler) {}

sparse_capture::sparse_capture(int stage, int replica)
    : stage_(stage), replica_(replica), distributed_(true), scaler_(nullptr) {}

void sparse_capture::on_step(std::int64_t iteration, float loss_grad,
                             const models::step_plan& plan) {
  steps_[iteration] = {loss_grad, plan};
}

namespace {
log_key key_of(std::int64_t iteration, int micro_batch, engine::boundary kind, int replica) {
  return {
      std::uint64_t(iteration), std::uint32_t(micro_batch),
      kind == engine::boundary::activation ? log_direction::activation : log_direction::gradient,
      std::uint32_t(replica)};
}
}  // namespace

void sparse_capture::on_boundary_send(std::int64_t iteration, int micro_batch,
                                      engine::boundary kind, std::span<const float> tensor) {
  if (!log_.append(key_of(iteration, micro_batch, kind, replica_), std::as_bytes(tensor))) {
    ++log_conflicts_;
  }
}

void sparse_capture::log_sent(std::int64_t iteration, int micro_batch, engine::boundary kind,
                              std::vector<std::byte> bytes) {
  if (!log_.append(key_of(iteration, micro_batch, kind, replica_), std::move(bytes))) {
    ++log_conflicts_;
  }
}

void sparse_capture::after_step(std::int64_t iteration,
                                std::span<models::operator_state* const> ops) {
  if (auto w = begin_capture(iteration, ops)) {
    w->write();
    end_capture(*w);
  }
}

void sparse_capture::slot_write::write() const {
  if (device != nullptr) {
    write_snapshot(bytes, tag, scaler, ops, kinds, *device);
  } else {
    write_snapshot(bytes, tag, scaler, ops, kinds);
  }
}

std::optional<sparse_capture::slot_write> sparse_capture::begin_capture(
    std::int64_t iteration, std::span<models::operator_state* const> ops,
    std::optional<engine::checkpoint_place> place) {
  if (schedule_ == nullptr) return std::nullopt;  // W_sparse not chosen yet
  stage_schedule& schedule_ = *this->schedule_;
  if (!place || place->w_sparse < 1) {
    const auto w = std::uint64_t(schedule_.w_sparse());
    place = engine::checkpoint_place{int(w), std::uint64_t(iteration) / w,
                                     std::uint32_t(std::uint64_t(iteration) % w)};
  }
  const auto w = std::uint64_t(place->w_sparse);
  const std::uint64_t window = place->window;
  const std::uint32_t slot = place->slot;
  if (slot >= w) {
    throw std::invalid_argument(fmt::format("sparse capture: slot {} of a window of {}", slot, w));
  }
  const auto add_popularity = [&] {
    if (!distributed_) {
      schedule_.add_popularity(iteration, ops, window);
    } else if (counts_.size() == ops.size()) {
      schedule_.add_counts(iteration, counts_, window);
    }
  };
  if (ops.size() != schedule_.operators()) {
    throw std::invalid_argument("sparse capture: stage " + std::to_string(stage_) + " has " +
                                std::to_string(ops.size()) + " operators, the schedule " +
                                std::to_string(schedule_.operators()));
  }
  auto it = windows_.find(window);
  if (it == windows_.end()) {
    if (slot != 0 || (skipped_ && *skipped_ == window)) {
      // Started (or resumed) mid-window, or skipped: this window can never be complete; wait
      // for the next.
      add_popularity();
      return std::nullopt;
    }
    // How many windows this one is held beside (abandoned ones left aside: a recovery's, they
    // go at the next persist): the steady state trim_spares keeps memory for.
    std::size_t held = 1;
    for (const auto& [id, held_window] : windows_) {
      held += !abandoned_.contains(id) && !kept_before_persisted(id);
    }
    held_at_starts_[starts_++ % held_at_starts_.size()] = held;
    window_buffers b;
    b.first_iteration = iteration + 1;
    if (!spare_.empty()) {
      b.slots = std::move(spare_.back());
      spare_.pop_back();
      for (auto& s : b.slots) s.size = 0;  // memory kept, nothing captured yet
    }
    b.slots.resize(w);
    it = windows_.emplace(window, std::move(b)).first;
  }
  const auto& schedule = schedule_.window_schedule(window, int(w));
  if (schedule.size() != w) {
    throw std::invalid_argument(
        fmt::format("sparse capture: window {} was scheduled with {} slots, the step says {}",
                    window, schedule.size(), w));
  }
  const auto& sched = schedule[slot];
  {
    std::uint64_t& h = it->second.schedule_digest;
    auto mix = [&h](std::uint64_t v) {
      for (int b = 0; b < 8; ++b, v >>= 8) h = (h ^ (v & 0xff)) * 1099511628211ull;
    };
    mix(slot);
    for (auto i : sched.active) mix(i);
    mix(~std::uint64_t{0});
    for (auto i : sched.frozen) mix(i);
  }
  slot_write job;
  job.iteration = iteration;
  job.kinds.assign(ops.size(), capture_kind::skip);
  for (auto i : sched.active) job.kinds[i] = capture_kind::full;
  for (auto i : sched.frozen) job.kinds[i] = capture_kind::compute;
  job.ops.assign(ops.begin(), ops.end());
  auto& buf = it->second.slots[slot];
  // Same schedule slot as last window: same size, so the buffer is reused without allocating.
  fit(buf, snapshot_size(job.ops, job.kinds));
  job.bytes = buf.bytes();
  job.keep = buf.memory.owner;
  job.lent = buf.memory.lent;
  job.fresh = buf.memory.fresh;
  buf.memory.fresh = false;  // written from now on
  job.scaler = scaler_ ? *scaler_ : models::loss_scaler{};
  job.tag = {window, slot, iteration + 1, stage_, replica_};
  job.device = device_ != nullptr && device_->state_on_device() ? device_ : nullptr;
  add_popularity();
  writing_ = iteration;
  return job;
}

void sparse_capture::end_capture(const slot_write& job) {
  if (writing_ == job.iteration) writing_ = -1;
  const auto it = windows_.find(job.tag.window);
  if (it == windows_.end()) return;  // dropped meanwhile (a recovery): nothing to count
  last_slot_bytes_ = job.bytes.size();
  last_slot_lent_ = job.lent;
  last_slot_fresh_ = job.fresh;
  ++it->second.captured;
  const auto w = std::uint32_t(it->second.slots.size());
  if (!distributed_ && job.tag.slot + 1 == w && it->second.captured == int(w)) {
    persist(job.tag.window);
  }
}

void sparse_capture::fit(slot_buffer& buf, std::size_t n) {
  const bool fits = buf.memory.bytes.size() >= n;
  if (fits && (buf.memory.lent || !allocator_)) {
    buf.size = n;
    return;
  }
  if (allocator_) {
    if (auto m = allocator_(n)) {
      buf.memory = std::move(*m);  // heap memory it replaces is freed; lent memory given back
      page_lock(buf.memory);
      buf.size = n;
      return;
    }
  }
  if (!fits) {
    buf.memory = {};  // before allocating: a peak of one slot, not two
    std::shared_ptr<std::byte[]> heap;
    if (device_ != nullptr) {
      try {
        heap = device_->alloc_pinned(n);
      } catch (const std::exception& e) {
        unpinned(e.what());  // the heap then: copied into through the driver's staging
      }
    }
    if (!heap) heap = std::make_shared_for_overwrite<std::byte[]>(n);
    buf.memory = {{heap.get(), n}, heap, false};
  }
  buf.size = n;
}

void sparse_capture::page_lock(slot_memory& m) {
  if (device_ == nullptr || m.bytes.empty()) return;
  struct locked {
    std::shared_ptr<void> memory;
    std::shared_ptr<void> lock;  // destroyed first: unlocked before the memory goes
  };
  try {
    auto lock = device_->pin(m.bytes);
    m.owner = std::make_shared<locked>(locked{std::move(m.owner), std::move(lock)});
  } catch (const std::exception& e) {
    unpinned(e.what());  // still usable: the driver copies into pageable memory, more slowly
  }
}

void sparse_capture::unpinned(const char* why) {
  if (unpinned_slots_++ == 0) {
    fmt::print(stderr,
               "moevement: stage {} replica {}: slot memory not page-locked ({}); its "
               "snapshot copies go through the driver's staging buffers\n",
               stage_, replica_, why);
  }
}

void sparse_capture::persist(std::uint64_t window) {
  persisted_ = window;
  abandoned_.erase(window);  // persisted after all: it counts again
  recycle_before(window);    // keeps this window and the one in flight after it
  const std::int64_t first = windows_.at(window).first_iteration;
  log_.drop_before(std::uint64_t(first));
  steps_.erase(steps_.begin(), steps_.lower_bound(first));
}

void sparse_capture::skip_window(std::uint64_t window) {
  if (windows_.contains(window) || (skipped_ && *skipped_ >= window)) return;
  skipped_ = window;
  ++windows_skipped_;
}

void sparse_capture::drop_before(std::uint64_t window, std::int64_t first_iteration,
                                 const std::set<std::uint64_t>& keep, std::int64_t keep_from) {
  persisted_ = window;
  abandoned_.erase(window);  // persisted after all: it counts again
  kept_ = keep;
  recycle_before(window);
  const std::int64_t from = keep_from >= 0 ? std::min(first_iteration, keep_from) : first_iteration;
  log_.drop_before(std::uint64_t(std::max<std::int64_t>(from, 0)));
  steps_.erase(steps_.begin(), steps_.lower_bound(from));
}

std::size_t sparse_capture::abandon_ended_before(std::int64_t iteration) {
  std::size_t n = 0;
  for (const auto& [id, b] : windows_) {
    const bool newer = !persisted_ || id > *persisted_;
    // the step of iteration i captures slot j of the window whose first_iteration is
    // i + 1 - j, so slot 0's step was first_iteration - 1. A window begun before `iteration`
    // is lost whole, even one still being captured: the replacement does not join a window
    // mid-way (after_step) and the replay captures nothing.
    const bool begun = b.first_iteration <= iteration;
    if (newer && begun && abandoned_.insert(id).second) ++n;
  }
  return n;
}

void sparse_capture::unpin(std::uint64_t window) {
  pinned_.erase(window);
  const auto it = windows_.find(window);
  if (it == windows_.end() || !persisted_ || window >= *persisted_ || kept_.contains(window)) {
    return;
  }
  auto slots = std::move(it->second.slots);
  abandoned_.erase(it->first);
  windows_.erase(it);
  recycle(std::move(slots));
  trim_spares();
}

void sparse_capture::recycle_before(std::uint64_t window) {
  for (auto it = windows_.begin(); it != windows_.end() && it->first < window;) {
    if (pinned_.contains(it->first) || kept_.contains(it->first)) {
      ++it;
      continue;
    }
    auto slots = std::move(it->second.slots);
    abandoned_.erase(it->first);
    it = windows_.erase(it);
    recycle(std::move(slots));
  }
  trim_spares();
}

void sparse_capture::recycle(std::vector<slot_buffer> slots) {
  // A window begun while this one was still held (its persisting lagged the next capture) got
  // fresh memory for the slots captured so far only: its later slots take this window's
  // instead of new memory, and what is left is a spare. Without this every window of a job
  // whose persisting lags by a slot makes (and the pool frees) a window's memory again.
  for (auto& [id, b] : windows_) {
    for (std::size_t j = 0; j < b.slots.size() && j < slots.size(); ++j) {
      if (b.slots[j].memory.bytes.empty() && !slots[j].memory.bytes.empty()) {
        b.slots[j] = {std::move(slots[j].memory), 0};
        slots[j] = {};
      }
    }
  }
  const bool any = std::any_of(slots.begin(), slots.end(),
                               [](const slot_buffer& b) { return !b.memory.bytes.empty(); });
  if (any) spare_.push_back(std::move(slots));
}

std::size_t sparse_capture::windows_held() const {
  std::size_t n = 0;
  for (const auto& [id, b] : windows_) {
    const bool pinned_old = persisted_ && id < *persisted_ && pinned_.contains(id);
    n += !pinned_old && !kept_before_persisted(id) && !abandoned_.contains(id);
  }
  return n;
}

std::vector<std::span<const std::byte>> sparse_capture::window_slots(std::uint64_t window) const {
  std::vector<std::span<const std::byte>> out;
  if (!complete(window)) return out;
  for (const auto& s : windows_.at(window).slots) out.emplace_back(s.bytes());
  return out;
}

void sparse_capture::trim_spares() {
  // Buffers of dropped windows are reused by the next ones, but only as many as the steady
  // state holds: the persisted window and the one being captured, and a third where the
  // persist of a window arrives after the next one began (a window of one or two iterations
  // is that fast). Kept to two there, every window took new memory, whose first touch costs
  // ten to twenty times the copy. The steady state is the most windows held at the last few
  // window starts (the policy's bound on windows held, at most): a peak (replication behind, or a
  // window a recovery kept from persisting) must not stay allocated for good.
  std::size_t steady_windows = 2;
  for (std::size_t i = 0; i < std::min(starts_, held_at_starts_.size()); ++i) {
    steady_windows =
        std::max(steady_windows, std::min(held_at_starts_[i], policy_limits{}.max_windows_held));
  }
  // (Windows retained for the shadow checks are not of the steady state's.)
  std::size_t kept = 0;
  for (const auto& [id, b] : windows_) kept += kept_before_persisted(id);
  while (!spare_.empty() && windows_.size() - kept + spare_.size() > steady_windows) {
    spare_.pop_back();
  }
}

std::uint64_t sparse_capture::schedule_digest(std::uint64_t window) const {
  const auto it = windows_.find(window);
  return it == windows_.end() ? 0 : it->second.schedule_digest;
}

std::optional<engine::checkpoint_place> sparse_capture::place_of(std::int64_t iteration) const {
  // Slot j of a window is captured by the step of its first iteration - 1 + j. Windows may
  // overlap in steps: a standby head's windows start where it took over, part-way through one
  // its lost head began (and a rollback's where it went back to). The head numbers new windows
  // past every older one, so the newest that holds a step is where the step was captured.
  for (auto w = windows_.rbegin(); w != windows_.rend(); ++w) {
    const auto& [id, b] = *w;
    const std::int64_t j = iteration - (b.first_iteration - 1);
    if (j >= 0 && j < std::int64_t(b.slots.size())) {
      return engine::checkpoint_place{int(b.slots.size()), id, std::uint32_t(j)};
    }
  }
  return std::nullopt;
}

std::optional<std::span<const std::byte>> sparse_capture::slot_of(std::int64_t iteration) const {
  const auto place = place_of(iteration);
  if (!place) return std::nullopt;
  const auto& slot = windows_.at(place->window).slots[place->slot];
  if (slot.size == 0 || writing_ == iteration) return std::nullopt;  // none, or not written yet
  return std::span<const std::byte>(slot.bytes());
}

bool sparse_capture::complete(std::uint64_t window) const {
  const auto it = windows_.find(window);
  return it != windows_.end() && it->second.captured == int(it->second.slots.size());
}

std::int64_t sparse_capture::first_iteration(std::uint64_t window) const {
  const auto it = windows_.find(window);
  return it == windows_.end() ? -1 : it->second.first_iteration;
}

std::optional<window_view> sparse_capture::persisted() const {
  if (!persisted_) return std::nullopt;
  const auto& b = windows_.at(*persisted_);
  window_view v{*persisted_, b.first_iteration, {}};
  for (const auto& s : b.slots) v.slots.emplace_back(s.bytes());
  return v;
}

std::size_t sparse_capture::snapshot_bytes_held() const {
  std::size_t n = 0;
  for (const auto& [id, b] : windows_) {
    for (const auto& s : b.slots) n += s.memory.bytes.size();
  }
  for (const auto& spare : spare_) {
    for (const auto& s : spare) n += s.memory.bytes.size();
  }
  return n;
}

}  // namespace moevement::recovery
