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
  const int k = in.region_stages;
  if (k < 1 || in.stage < 0 || in.stage + k > in.stages) {
    throw conversion_error("sparse-to-dense: region of stages " + std::to_string(in.stage) + ".." +
                           std::to_string(in.stage + k - 1) + " is outside the pipeline");
  }
  if (replicas.empty() || replicas.size() % std::size_t(k) != 0) {
    throw conversion_error("sparse-to-dense: " + std::to_string(replicas.size()) +
                           " stage models for a region of " + std::to_string(k) + " stages");
  }
  const std::size_t d_count = replicas.size() / std::size_t(k);  // replicas of each stage
  const std::size_t all = replicas.size();
  if (in.reduce && d_count != 1) {
    throw conversion_error("sparse-to-dense: a parallel group replay gives one replica per stage");
  }
  if (in.windows.size() != all) {
    throw conversion_error("sparse-to-dense: " + std::to_string(in.windows.size()) +
                           " windows for " + std::to_string(all) + " stage replicas");
  }
  if (in.steps == nullptr) throw conversion_error("sparse-to-dense: no step plans given");
  const bool starts = in.stage == 0, ends = in.stage + k == in.stages;
  const auto stage_of = [&](std::size_t i) { return in.stage + int(i / d_count); };

  // Parse and verify every slot before touching the stages. Index i = j * d_count + d.
  std::vector<std::vector<snapshot_view>> views(all);
  std::vector<std::vector<models::operator_state*>> ops(all);
  bool from_initial = true;
  for (const auto& win : in.windows) from_initial = from_initial && win.empty();
  for (std::size_t i = 0; i < all; ++i) {
    const std::size_t d = in.first_replica + i % d_count;
    const int s = stage_of(i);
    ops[i] = replicas[i]->operators();
    if (from_initial) continue;
    if (in.windows[i].empty()) {
      throw conversion_error("sparse-to-dense: " + where(s, d) + " has an empty window");
    }
    for (std::size_t j = 0; j < in.windows[i].size(); ++j) {
      try {
        views[i].push_back(parse_snapshot(in.windows[i][j]));
      } catch (const snapshot_error& e) {
        throw snapshot_error("sparse-to-dense: slot " + std::to_string(j) + " of " + where(s, d) +
                             ": " + e.what());
      }
      const snapshot_tag& tag = views[i].back().tag;
      const snapshot_tag& t0 = views[i].front().tag;
      if (tag.slot != j || tag.window != t0.window ||
          tag.state_iteration != t0.state_iteration + std::int64_t(j) || tag.stage != s ||
          tag.replica != std::int32_t(d)) {
        throw conversion_error("sparse-to-dense: slot " + std::to_string(j) + " of " + where(s, d) +
                               " is tagged window " + std::to_string(tag.window) + " slot " +
                               std::to_string(tag.slot) + " " +
                               where(tag.stage, std::size_t(tag.replica)) +
                               ": not the window asked for");
      }
      for (const auto& e : views[i].back().entries) {
        if (e.index >= ops[i].size()) {
          throw conversion_error("sparse-to-dense: slot " + std::to_string(j) + " names operator " +
                                 std::to_string(e.index) + " of " + std::to_string(ops[i].size()));
        }
      }
    }
    if (views[i].size() != views[0].size() ||
        views[i][0].tag.state_iteration != views[0][0].tag.state_iteration ||
        views[i][0].tag.window != views[0][0].tag.window) {
      throw conversion_error("sparse-to-dense: " + where(s, d) + " holds another window than " +
                             where(in.stage, 0));
    }
  }
  if (from_initial) {
    for (std::size_t i = 0; i < all; ++i) {
      for (const auto* op : ops[i]) {
        if (op->mode() != models::op_mode::active) {
          throw conversion_error(
              "sparse-to-dense: a replay from the initial state needs fresh "
              "replicas, but " +
              op->name() + " is frozen");
        }
      }
    }
  }
  const std::size_t w = views[0].size();
  std::size_t n_all = 0;  // operators of the region (one replica of each stage)
  for (int j = 0; j < k; ++j) {
    const std::size_t base = std::size_t(j) * d_count;  // replica 0 of stage `stage + j`
    const std::size_t n = ops[base].size();
    n_all += n;
    // The recovery group must freeze the same operators, or the reduced gradients are wrong.
    for (std::size_t d = 1; d < d_count; ++d) {
      for (std::size_t sl = 0; sl < w; ++sl) {
        const auto& a = views[base][sl].entries;
        const auto& b = views[base + d][sl].entries;
        bool same = a.size() == b.size();
        for (std::size_t e = 0; same && e < a.size(); ++e) {
          same = a[e].index == b[e].index && a[e].mode == b[e].mode;
        }
        if (!same) {
          throw conversion_error("sparse-to-dense: " + where(in.stage + j, 0) + " and replica " +
                                 std::to_string(d) + " scheduled slot " + std::to_string(sl) +
                                 " differently");
        }
      }
    }
    // Every operator full in exactly one slot, with compute weights in every slot before it.
    std::vector<int> full_slot(n, from_initial ? 0 : -1);
    for (std::size_t sl = 0; sl < w; ++sl) {
      std::vector<bool> present(n, false);
      for (const auto& e : views[base][sl].entries) {
        present[e.index] = true;
        if (e.mode == models::op_mode::active) {
          if (full_slot[e.index] >= 0) {
            throw conversion_error("sparse-to-dense: operator " + e.name + " is full in slots " +
                                   std::to_string(full_slot[e.index]) + " and " +
                                   std::to_string(sl));
          }
          full_slot[e.index] = int(sl);
        }
      }
      for (std::size_t o = 0; o < n; ++o) {
        if (full_slot[o] < 0 && !present[o]) {
          throw conversion_error("sparse-to-dense: slot " + std::to_string(sl) +
                                 " has neither the state nor the compute weights of operator " +
                                 ops[base][o]->name());
        }
      }
    }
    for (std::size_t o = 0; o < n; ++o) {
      if (full_slot[o] < 0) {
        throw conversion_error("sparse-to-dense: the window never holds the full state of " +
                               ops[base][o]->name() + " (incomplete window)");
      }
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

  std::size_t active = from_initial ? n_all : 0;
  const auto load_slot = [&](std::size_t sl) {
    for (std::size_t i = 0; i < all; ++i) {
      for (const auto& e : views[i][sl].entries) load_operator(e, *ops[i][e.index]);
      // the replay steps on the host: a GPU stage's device copy is reloaded when it next
      // steps there
      if (engine::device_state* d = replicas[i]->device()) d->host_changed();
    }
    active = 0;
    for (int j = 0; j < k; ++j) {
      for (const auto* op : ops[std::size_t(j) * d_count]) {
        active += op->mode() == models::op_mode::active ? 1 : 0;
      }
    }
    rep.active_after_slot.push_back(active);
  };

  const std::size_t floats = replicas[0]->boundary_floats();
  std::vector<float> acc, g;
  std::vector<engine::stage_model*> region(std::size_t(k), nullptr);
  for (std::int64_t it = w0; it < t; ++it) {
    if (std::size_t(it - w0) < w) load_slot(std::size_t(it - w0));
    const step_record& step = in.steps->at(it);
    for (std::size_t d = 0; d < d_count; ++d) {
      const std::size_t gd = in.first_replica + d;  // the replica's index in the group
      engine::replay_inputs ri{in.stage, in.stages, in.micro_batches, {}, {}};
      for (int mb = 0; mb < in.micro_batches; ++mb) {
        if (!starts) {
          ri.activations.push_back(logged(d < in.upstream.size() ? in.upstream[d] : nullptr, it, mb,
                                          log_direction::activation, gd, in.stage - 1, floats));
        }
        if (!ends) {
          ri.gradients.push_back(logged(d < in.downstream.size() ? in.downstream[d] : nullptr, it,
                                        mb, log_direction::gradient, gd, in.stage + k, floats));
        }
      }
      for (int j = 0; j < k; ++j) region[std::size_t(j)] = replicas[std::size_t(j) * d_count + d];
      const auto outs = engine::replay_region(region, it, step.loss_grad, ri);
      for (int j = 0; j < k; ++j) {
        const int s = in.stage + j;
        const bool first = s == 0, last = s + 1 == in.stages;
        const auto& out = outs[std::size_t(j)];
        if (active < n_all) ++rep.sparse_replays;
        const std::size_t i = std::size_t(j) * d_count + d;
        const log_store* own = i < in.own.size() ? in.own[i] : nullptr;
        for (int mb = 0; mb < in.micro_batches; ++mb) {
          const auto m = std::size_t(mb);
          if (!last) {
            if (in.on_sent)
              in.on_sent(s, it, mb, log_direction::activation, gd, out.activations[m]);
            check_sent(own, it, mb, log_direction::activation, gd, out.activations[m],
                       rep.tensors_checked);
          }
          if (!first) {
            if (in.on_sent) in.on_sent(s, it, mb, log_direction::gradient, gd, out.gradients[m]);
            check_sent(own, it, mb, log_direction::gradient, gd, out.gradients[m],
                       rep.tensors_checked);
          }
        }
      }
    }
    if (in.reduce) {
      // The group's other replicas replay on other workers: one sum of every region stage's
      // gradients with theirs.
      std::size_t total = 0;
      for (int j = 0; j < k; ++j) total += engine::gradient_floats(ops[std::size_t(j) * d_count]);
      acc.resize(total);
      std::size_t off = 0;
      for (int j = 0; j < k; ++j) {
        const auto& o = ops[std::size_t(j) * d_count];
        const std::size_t n = engine::gradient_floats(o);
        engine::copy_gradients_out(o, std::span(acc).subspan(off, n));
        off += n;
      }
      in.reduce(it, acc);
      off = 0;
      for (int j = 0; j < k; ++j) {
        const auto& o = ops[std::size_t(j) * d_count];
        const std::size_t n = engine::gradient_floats(o);
        engine::copy_gradients_in(o, std::span<const float>(acc).subspan(off, n));
        off += n;
      }
    }
    for (int j = 0; j < k; ++j) {
      const std::size_t base = std::size_t(j) * d_count;
      // The all-reduce as the engine does it: g_0 + g_1 + ... in replica order.
      if (d_count > 1 && !in.reduce) {
        acc.resize(engine::gradient_floats(ops[base]));
        g.resize(acc.size());
        engine::copy_gradients_out(ops[base], acc);
        for (std::size_t d = 1; d < d_count; ++d) {
          engine::copy_gradients_out(ops[base + d], g);
          engine::accumulate(acc, g);
        }
        for (std::size_t d = 0; d < d_count; ++d) engine::copy_gradients_in(ops[base + d], acc);
      }
      for (std::size_t d = 0; d < d_count; ++d) {
        engine::apply_step(ops[base + d], step.plan, in.train);
      }
    }
  }
  // t at the window's last slot: that slot is the state at t already.
  if (std::size_t(t - w0) < w) load_slot(std::size_t(t - w0));
  if (active != n_all) {
    throw conversion_error("sparse-to-dense: " + std::to_string(n_all - active) +
                           " operators still frozen at the end (internal error)");
  }
  return rep;
}

}  // namespace moevement::recovery
