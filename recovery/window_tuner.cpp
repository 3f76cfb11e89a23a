#include "recovery/window_tuner.hpp"

#include <algorithm>
#include <cmath>

#include "sim/ettr.hpp"

namespace moevement::recovery {

double window_tuner::cost_of(const engine::iteration_cost& c) const {
  const double cpu =
      c_.cores > 0
          ? (std::max(0.0, c.capture_cpu_s) + std::max(0.0, c.replication_cpu_s)) / c_.cores
          : 0.0;
  return std::max(0.0, c.stall_s) + std::max(0.0, c.log_s) + cpu;
}

void window_tuner::add(const engine::iteration_cost& c) {
  if (!(c.seconds > 0)) return;
  if (double(c.fresh_bytes) > warm_up_share * double(c.snapshot_bytes)) {
    ++warm_ups_;  // the kernel made pages for it: a one-off, not the steady cost
    return;
  }
  const double cost = cost_of(c);
  if (cost > m_.worst_cost) {
    m_.worst_cost = cost;
    m_.worst_seconds = c.seconds;
  }
  m_.cost += cost;
  ++m_.iterations;
  m_.seconds += c.seconds;
  m_.stall_s += std::max(0.0, c.stall_s);
  m_.log_s += std::max(0.0, c.log_s);
  m_.capture_cpu_s += std::max(0.0, c.capture_cpu_s);
  m_.replication_cpu_s += std::max(0.0, c.replication_cpu_s);
}

double window_tuner::predicted_ettr(int w, double o, int w_measured, double t) const {
  const double overhead = o * double(w_measured) / double(std::max(w, 1));
  return sim::window_ettr(overhead, w, t, c_.restart_s, c_.mtbf_s);
}

std::optional<window_tuner::decision> window_tuner::decide(int w) {
  const bool ettr = c_.mtbf_s > 0;
  if ((!ettr && !(c_.max_overhead > 0)) || m_.iterations < std::max(w, min_iterations)) {
    return std::nullopt;
  }
  decision d;
  d.previous = w;
  d.iterations = m_.iterations;
  d.seconds = m_.seconds;
  d.stall_s = m_.stall_s;
  d.log_s = m_.log_s;
  d.capture_cpu_s = m_.capture_cpu_s;
  d.replication_cpu_s = m_.replication_cpu_s;
  d.cpu_share_s = c_.cores > 0 ? (m_.capture_cpu_s + m_.replication_cpu_s) / c_.cores : 0.0;
  // Less the costliest iteration: the steady cost, not a one-off.
  const double cost = m_.cost - std::max(0.0, m_.worst_cost);
  const double seconds = m_.seconds - m_.worst_seconds;
  d.overhead = std::max(0.0, cost) / std::max(seconds - cost, 1e-9);
  // A ceiling not known yet (no stage reported its operators) holds W where it is.
  const int ceiling = c_.ceiling > 0 ? c_.ceiling : std::max(w, 1);
  d.w = w;
  if (ettr) {
    const double t = (seconds - cost) / double(std::max(m_.iterations - 1, 1));
    d.ettr_rule = true;
    d.previous_ettr = predicted_ettr(w, d.overhead, w, t);
    const int lo = std::max(1, w / 2);
    const int hi = std::min(ceiling, std::max(w, int(std::ceil(double(w) * grow_at_most))));
    int best = w;
    double best_ettr = d.previous_ettr;
    for (int c = lo; c <= hi; ++c) {
      const double e = predicted_ettr(c, d.overhead, w, t);
      if (e > best_ettr) {
        best_ettr = e;
        best = c;
      }
    }
    // Near the optimum the prediction is flat and the measured cost noisy: W moves only for a
    // gain worth a window of new slot memory.
    if (best_ettr > d.previous_ettr * (1.0 + min_ettr_gain)) d.w = best;
    d.capped = d.w > ceiling;  // (a resume at a deeper pipeline: fewer operators per stage)
    d.w = std::clamp(d.w, 1, ceiling);
    d.predicted_ettr = predicted_ettr(d.w, d.overhead, w, t);
    m_ = {};
    return d;
  }
  calm_ = d.overhead < c_.max_overhead / 4 ? calm_ + 1 : 0;
  if (d.overhead > c_.max_overhead) {
    const double grow = std::min(grow_at_most, d.overhead / c_.max_overhead);
    d.w = std::max(w + 1, int(std::ceil(double(w) * grow)));
  } else if (calm_ >= calm_decisions) {
    d.w = w / 2;
    calm_ = 0;
  }
  d.capped = d.w > ceiling;
  d.w = std::clamp(d.w, 1, ceiling);
  m_ = {};
  return d;
}

}  // namespace moevement::recovery
