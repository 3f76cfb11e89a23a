#include "recovery/sparse_to_dense.hpp"

#include <cstring>
#include <string>

#include "engine/replay.hpp"

namespace moevement::recovery {
namespace {

std::string where(int stage, std::size_t replica) {
  return "stage " + std::to_string(stage) + " replica " + std::to_string(replica);
}

// The logged tensor of (iteration, mb, direction, replica) as floats.
std::vector<float> logged(const log_store* log, std::int64_t iteration, int mb, log_direction dir,
                          std::size_t replica, int sender, std::size_t floats) {
  const char* what = dir == log_direction::activation ? "activation" : "gradient";
  if (log == nullptr) {
    throw conversion_error("sparse-to-dense: no log of stage " + std::to_string(sender) +
                           " replica " + std::to_string(replica) + " (the " + what +
                           "s it sent are needed)");
  }
  const auto bytes =
      log->find({std::uint64_t(iteration), std::uint32_t(mb), dir, std::uint32_t(replica)});
  if (!bytes) {
    throw conversion_error("sparse-to-dense: the log of stage " + std::to_string(sender) +
                           " replica " + std::to_string(replica) + " has no " + what +
                           " of iteration " + std::to_string(iteration) + " micro-batch " +
                           std::to_string(mb) + " (dropped too early, or never logged)");
  }
  if (bytes->size() != floats * sizeof(float)) {
    throw conversion_error("sparse-to-dense: logged " + std::string(what) + " of iteration " +
                           std::to_string(iteration) + " micro-batch " + std::to_string(mb) +
                           " has " + std::to_string(bytes->size()) + " bytes, expected " +
                           std::to_string(floats * sizeof(float)));
  }
  std::vector<float> t(floats);
  std::memcpy(t.data(), bytes->data(), bytes->size());
  return t;
}

void check_sent(const log_store* own, std::int64_t iteration, int mb, log_direction dir,
                std::size_t replica, std::span<const float> sent, std::size_t& checked) {
  if (own == nullptr) return;
  const auto bytes =
      own->find({std::uint64_t(iteration), std::uint32_t(mb), dir, std::uint32_t(replica)});
  if (!bytes) return;
  if (bytes->size() != sent.size_bytes() ||
      std::memcmp(bytes->data(), sent.data(), sent.size_bytes()) != 0) {
    throw conversion_error("sparse-to-dense: the replay of iteration " + std::to_string(iteration) +
                           " micro-batch " + std::to_string(mb) + " replica " +
                           std::to_string(replica) + " sent other bits than logged: " +
                           "determinism is broken (different build, flags or inputs?)");
  }
  ++checked;
}

}  // namespace

conversion_report sparse_to_dense(std::span<engine::stage_model* const> replicas,
                                  const conversion_input& in) {
  const std::size_t d_count = replicas.size();
  if (d_count == 0) throw conversion_error("sparse-to-dense: no replicas to rebuild");
  if (in.windows.size() != d_count) {
    throw conversion_error("sparse-to-dense: " + std::to_string(in.windows.size()) +
                           " windows for " + std::to_string(d_count) + " replicas");
  }
  if (in.steps == nullptr) throw conversion_error("sparse-to-dense: no step plans given");
  const bool first = in.stage == 0, last = in.stage + 1 == in.stages;

  // Parse and verify every slot before touching the stage.
  std::vector<std::vector<snapshot_view>> views(d_count);
  std::vector<std::vector<models::operator_state*>> ops(d_count);
  bool from_initial = true;
  for (const auto& win : in.windows) from_initial = from_initial && win.empty();
  for (std::size_t d = 0; d < d_count; ++d) {
    ops[d] = replicas[d]->operators();
    if (from_initial) continue;
    if (in.windows[d].empty()) {
      throw conversion_error("sparse-to-dense: " + where(in.stage, d) + " has an empty window");
    }
    for (std::size_t j = 0; j < in.windows[d].size(); ++j) {
      try {
        views[d].push_back(parse_snapshot(in.windows[d][j]));
      } catch (const snapshot_error& e) {
        throw snapshot_error("sparse-to-dense: slot " + std::to_string(j) + " of " +
                             where(in.stage, d) + ": " + e.what());
      }
      const snapshot_tag& tag = views[d].back().tag;
      const snapshot_tag& t0 = views[d].front().tag;
      if (tag.slot != j || tag.window != t0.window ||
          tag.state_iteration != t0.state_iteration + std::int64_t(j) || tag.stage != in.stage ||
          tag.replica != std::int32_t(d)) {
        throw conversion_error("sparse-to-dense: slot " + std::to_string(j) + " of " +
                               where(in.stage, d) + " is tagged window " +
                               std::to_string(tag.window) + " slot " + std::to_string(tag.slot) +
                               " " + where(tag.stage, std::size_t(tag.replica)) +
                               ": not the window asked for");
      }
      for (const auto& e : views[d].back().entries) {
        if (e.index >= ops[d].size()) {
          throw conversion_error("sparse-to-dense: slot " + std::to_string(j) + " names operator " +
                                 std::to_string(e.index) + " of " + std::to_string(ops[d].size()));
        }
      }
    }
    if (views[d].size() != views[0].size() ||
        views[d][0].tag.state_iteration != views[0][0].tag.state_iteration) {
      throw conversion_error("sparse-to-dense: replicas hold different windows");
    }
  }
  const std::size_t w = views[0].size(), n = ops[0].size();
  if (from_initial) {
    for (std::size_t d = 0; d < d_count; ++d) {
      for (const auto* op : ops[d]) {
        if (op->mode() != models::op_mode::active) {
          throw conversion_error(
              "sparse-to-dense: a replay from the initial state needs fresh "
              "replicas, but " +
              op->name() + " is frozen");
        }
      }
    }
  }
  // The recovery group must freeze the same operators, or the reduced gradients are wrong.
  for (std::size_t d = 1; d < d_count; ++d) {
    for (std::size_t j = 0; j < w; ++j) {
      const auto& a = views[0][j].entries;
      const auto& b = views[d][j].entries;
      bool same = a.size() == b.size();
      for (std::size_t k = 0; same && k < a.size(); ++k) {
        same = a[k].index == b[k].index && a[k].mode == b[k].mode;
      }
      if (!same) {
        throw conversion_error("sparse-to-dense: replicas 0 and " + std::to_string(d) +
                               " scheduled slot " + std::to_string(j) + " differently");
      }
    }
  }
  // Every operator full in exactly one slot, with compute weights in every slot before it.
  std::vector<int> full_slot(n, from_initial ? 0 : -1);
  for (std::size_t j = 0; j < w; ++j) {
    std::vector<bool> present(n, false);
    for (const auto& e : views[0][j].entries) {
      present[e.index] = true;
      if (e.mode == models::op_mode::active) {
        if (full_slot[e.index] >= 0) {
          throw conversion_error("sparse-to-dense: operator " + e.name + " is full in slots " +
                                 std::to_string(full_slot[e.index]) + " and " + std::to_string(j));
        }
        full_slot[e.index] = int(j);
      }
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (full_slot[i] < 0 && !present[i]) {
        throw conversion_error("sparse-to-dense: slot " + std::to_string(j) +
                               " has neither the state nor the compute weights of operator " +
                               ops[0][i]->name());
      }
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (full_slot[i] < 0) {
      throw conversion_error("sparse-to-dense: the window never holds the full state of " +
                             ops[0][i]->name() + " (incomplete window)");
    }
  }

  conversion_report rep;
  rep.window = from_initial ? 0 : views[0][0].tag.window;
  rep.first_iteration = from_initial ? in.initial_iteration : views[0][0].tag.state_iteration;
  const std::int64_t w0 = rep.first_iteration, t = in.target_iteration;
  if (t < w0 + std::int64_t(w) - 1) {
    throw conversion_error("sparse-to-dense: iteration " + std::to_string(t) +
                           " is inside the window starting at " + std::to_string(w0) +
                           "; recover from the window before");
  }
  for (std::int64_t it = w0; it < t; ++it) {
    if (!in.steps->contains(it)) {
      throw conversion_error("sparse-to-dense: no step plan of iteration " + std::to_string(it));
    }
  }
  rep.iterations_replayed = int(t - w0);

  std::size_t active = from_initial ? n : 0;
  const auto load_slot = [&](std::size_t j) {
    for (std::size_t d = 0; d < d_count; ++d) {
      for (const auto& e : views[d][j].entries) load_operator(e, *ops[d][e.index]);
    }
    active = 0;
    for (const auto* op : ops[0]) active += op->mode() == models::op_mode::active ? 1 : 0;
    rep.active_after_slot.push_back(active);
  };

  const std::size_t floats = replicas[0]->boundary_floats();
  std::vector<float> acc, g;
  for (std::int64_t it = w0; it < t; ++it) {
    if (std::size_t(it - w0) < w) load_slot(std::size_t(it - w0));
    const step_record& step = in.steps->at(it);
    for (std::size_t d = 0; d < d_count; ++d) {
      engine::replay_inputs ri{in.stage, in.stages, in.micro_batches, {}, {}};
      for (int mb = 0; mb < in.micro_batches; ++mb) {
        if (!first) {
          ri.activations.push_back(logged(d < in.upstream.size() ? in.upstream[d] : nullptr, it, mb,
                                          log_direction::activation, d, in.stage - 1, floats));
        }
        if (!last) {
          ri.gradients.push_back(logged(d < in.downstream.size() ? in.downstream[d] : nullptr, it,
                                        mb, log_direction::gradient, d, in.stage + 1, floats));
        }
      }
      const auto out = engine::replay_iteration(*replicas[d], it, step.loss_grad, ri);
      if (active < n) ++rep.sparse_replays;
      const log_store* own = d < in.own.size() ? in.own[d] : nullptr;
      for (int mb = 0; mb < in.micro_batches && in.on_sent; ++mb) {
        if (!last)
          in.on_sent(it, mb, log_direction::activation, d, out.activations[std::size_t(mb)]);
        if (!first) in.on_sent(it, mb, log_direction::gradient, d, out.gradients[std::size_t(mb)]);
      }
      for (int mb = 0; mb < in.micro_batches; ++mb) {
        if (!last) {
          check_sent(own, it, mb, log_direction::activation, d, out.activations[std::size_t(mb)],
                     rep.tensors_checked);
        }
        if (!first) {
          check_sent(own, it, mb, log_direction::gradient, d, out.gradients[std::size_t(mb)],
                     rep.tensors_checked);
        }
      }
    }
    // The all-reduce as the engine does it: g_0 + g_1 + ... in replica order.
    if (d_count > 1) {
      acc.resize(engine::gradient_floats(ops[0]));
      g.resize(acc.size());
      engine::copy_gradients_out(ops[0], acc);
      for (std::size_t d = 1; d < d_count; ++d) {
        engine::copy_gradients_out(ops[d], g);
        engine::accumulate(acc, g);
      }
      for (std::size_t d = 0; d < d_count; ++d) engine::copy_gradients_in(ops[d], acc);
    }
    for (std::size_t d = 0; d < d_count; ++d) engine::apply_step(ops[d], step.plan, in.train);
  }
  // t at the window's last slot: that slot is the state at t already.
  if (std::size_t(t - w0) < w) load_slot(std::size_t(t - w0));
  if (active != n) {
    throw conversion_error("sparse-to-dense: " + std::to_string(n - active) +
                           " operators still frozen at the end (internal error)");
  }
  return rep;
}

}  // namespace moevement::recovery
