#include "sim/sparse_schedule.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>
#include <stdexcept>

namespace moevement::sim {
namespace {

void require_schedule(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("sparse schedule: ") + what);
}

int ceil_div(std::size_t a, std::size_t b) {
  return static_cast<int>((a + b - 1) / b);
}

}  // namespace

window_size find_window_size(std::size_t o_total, double t_iter_s, double s_compute,
                             double s_master, double s_optim, double bandwidth_bytes_per_s) {
  require_schedule(o_total > 0, "no operators (O_total must be at least 1)");
  require_schedule(t_iter_s > 0, "iteration time must be positive");
  require_schedule(bandwidth_bytes_per_s > 0, "snapshot bandwidth must be positive");
  require_schedule(s_compute >= 0 && s_master >= 0 && s_optim >= 0, "operator sizes must be >= 0");
  const auto size_for = [&](std::size_t active) {
    return (s_master + s_optim) * static_cast<double>(active) +
           s_compute * static_cast<double>(o_total - active);
  };
  // Lines 9-16 of Algorithm 1, including that the loop stops at 2 without testing 2.
  std::size_t o_active = o_total;
  while (o_active > 2) {
    if (size_for(o_active) / bandwidth_bytes_per_s <= t_iter_s) break;
    --o_active;
  }
  window_size w;
  w.o_active = static_cast<int>(o_active);
  w.w_sparse = ceil_div(o_total, o_active);
  w.slot_bytes = size_for(o_active);
  w.slot_seconds = w.slot_bytes / bandwidth_bytes_per_s;
  w.fits = w.slot_seconds <= t_iter_s;
  return w;
}

namespace {

// Largest slot of the schedule over `ordered` with `active` operators per slot. prefix_full[i]
// = sum of master+optim of ordered[0, i); suffix_compute[i] = sum of compute of ordered[i, n).
double largest_slot(std::size_t n, std::size_t active, std::span<const double> prefix_full,
                    std::span<const double> suffix_compute) {
  double largest = 0;
  for (std::size_t start = 0; start < n; start += active) {
    const std::size_t end = std::min(start + active, n);
    largest = std::max(largest, prefix_full[end] - prefix_full[start] + suffix_compute[end]);
  }
  return largest;
}

}  // namespace

window_size find_window_size(std::span<const sparse_op> ordered, double t_iter_s,
                             double bandwidth_bytes_per_s) {
  require_schedule(!ordered.empty(), "no operators (O_total must be at least 1)");
  require_schedule(t_iter_s > 0, "iteration time must be positive");
  require_schedule(bandwidth_bytes_per_s > 0, "snapshot bandwidth must be positive");
  const std::size_t n = ordered.size();
  std::vector<double> prefix_full(n + 1, 0.0), suffix_compute(n + 1, 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    prefix_full[i + 1] = prefix_full[i] + static_cast<double>(ordered[i].master_bytes) +
                         static_cast<double>(ordered[i].optim_bytes);
  }
  for (std::size_t i = n; i-- > 0;) {
    suffix_compute[i] = suffix_compute[i + 1] + static_cast<double>(ordered[i].compute_bytes);
  }
  std::size_t o_active = n;
  while (o_active > 2) {
    if (largest_slot(n, o_active, prefix_full, suffix_compute) / bandwidth_bytes_per_s <= t_iter_s)
      break;
    --o_active;
  }
  window_size w;
  w.o_active = static_cast<int>(o_active);
  w.w_sparse = ceil_div(n, o_active);
  w.slot_bytes = largest_slot(n, o_active, prefix_full, suffix_compute);
  w.slot_seconds = w.slot_bytes / bandwidth_bytes_per_s;
  w.fits = w.slot_seconds <= t_iter_s;
  return w;
}

std::vector<std::size_t> order_by_popularity(std::span<const sparse_op> ops) {
  std::vector<std::size_t> order(ops.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return ops[a].popularity < ops[b].popularity;
  });
  return order;
}

double time_decayed_popularity(double previous, double count_this_batch, double alpha) {
  require_schedule(alpha >= 0 && alpha <= 1, "decay alpha must be in [0, 1]");
  return alpha * previous + (1 - alpha) * count_this_batch;
}

double capacity_normalized_popularity(double count, double capacity) {
  require_schedule(capacity > 0, "expert capacity must be positive");
  return count / capacity;
}

std::vector<schedule_slot> generate_schedule(std::span<const std::size_t> order, int w_sparse,
                                             int o_active) {
  require_schedule(w_sparse >= 1, "W_sparse must be at least 1");
  require_schedule(o_active >= 1, "O_active must be at least 1");
  const std::size_t n = order.size();
  require_schedule(static_cast<std::size_t>(w_sparse) * static_cast<std::size_t>(o_active) >= n,
                   "W_sparse * O_active must cover every operator");
  std::vector<schedule_slot> schedule;
  schedule.reserve(static_cast<std::size_t>(w_sparse));
  for (int i = 0; i < w_sparse; ++i) {
    const std::size_t start = std::min(n, static_cast<std::size_t>(i) * o_active);
    const std::size_t end = std::min(start + static_cast<std::size_t>(o_active), n);
    schedule_slot slot;
    slot.active.assign(order.begin() + static_cast<std::ptrdiff_t>(start),
                       order.begin() + static_cast<std::ptrdiff_t>(end));
    slot.frozen.assign(order.begin() + static_cast<std::ptrdiff_t>(end), order.end());
    schedule.push_back(std::move(slot));
  }
  return schedule;
}

double slot_bytes(const schedule_slot& slot, std::span<const sparse_op> ops) {
  double bytes = 0;
  for (const auto i : slot.active) {
    bytes += static_cast<double>(ops[i].master_bytes) + static_cast<double>(ops[i].optim_bytes);
  }
  for (const auto i : slot.frozen) bytes += static_cast<double>(ops[i].compute_bytes);
  return bytes;
}

std::string check_schedule(std::span<const schedule_slot> schedule, std::size_t n) {
  std::vector<int> active_slot(n, -1);
  std::ostringstream problems;
  for (std::size_t s = 0; s < schedule.size(); ++s) {
    for (const auto i : schedule[s].active) {
      if (i >= n) {
        problems << "slot " << s << " names operator " << i << " of " << n << "; ";
      } else if (active_slot[i] >= 0) {
        problems << "operator " << i << " active in slots " << active_slot[i] << " and " << s
                 << "; ";
      } else {
        active_slot[i] = static_cast<int>(s);
      }
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (active_slot[i] < 0) {
      problems << "operator " << i << " is never active; ";
      continue;
    }
    for (std::size_t s = 0; s < schedule.size(); ++s) {
      const auto& f = schedule[s].frozen;
      const bool frozen_here = std::find(f.begin(), f.end(), i) != f.end();
      const bool should = static_cast<int>(s) < active_slot[i];
      if (frozen_here != should) {
        problems << "operator " << i << (should ? " missing from" : " wrongly in")
                 << " the frozen set of slot " << s << "; ";
      }
    }
  }
  return problems.str();
}

std::vector<bool> active_after_slot(std::span<const schedule_slot> schedule, std::size_t n, int j) {
  require_schedule(j >= 0 && static_cast<std::size_t>(j) < schedule.size(),
                   "slot index out of range");
  std::vector<bool> active(n, false);
  for (int s = 0; s <= j; ++s) {
    for (const auto i : schedule[static_cast<std::size_t>(s)].active) active.at(i) = true;
  }
  return active;
}

bool should_reorder(std::span<const double> old_popularity, std::span<const double> new_popularity,
                    reorder_thresholds thresholds) {
  require_schedule(old_popularity.size() == new_popularity.size(),
                   "popularity vectors differ in length");
  if (old_popularity.empty()) return false;
  std::size_t changed = 0;
  for (std::size_t i = 0; i < old_popularity.size(); ++i) {
    const double before = old_popularity[i];
    const double delta = std::abs(new_popularity[i] - before);
    // An operator that had no activations and now has some counts as changed.
    if (before == 0 ? delta > 0 : delta > thresholds.change_threshold * std::abs(before)) ++changed;
  }
  return static_cast<double>(changed) >=
         thresholds.fraction_threshold * static_cast<double>(old_popularity.size());
}

}  // namespace moevement::sim
