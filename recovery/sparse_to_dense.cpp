#include "recovery/sparse_to_dense.hpp"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "engine/checkpoint.hpp"
#include "engine/local_group.hpp"
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
    throw engine::replay_mismatch(
        "sparse-to-dense: the replay of iteration " + std::to_string(iteration) + " micro-batch " +
            std::to_string(mb) + " replica " + std::to_string(replica) +
            " sent other bits than logged: silent " +
            "data corruption of what was sent then (or broken determinism: a " +
            "different build, flags or inputs)",
        iteration);
  }
  ++checked;
}

// One conversion: the inputs checked (windows parsed and verified, every stage's slot schedule
// complete and the same on every replica, the step plans there), then the replay, iteration by
// iteration. Index i = j * d_count + d: replica d of stage `stage + j`.
class conversion {
 public:
  conversion(std::span<engine::stage_model* const> replicas, const conversion_input& in)
      : replicas_(replicas), in_(in) {}

  conversion_report run() {
    check_region();
    parse_windows();
    check_schedules();
    check_range();
    active_ = from_initial_ ? n_all_ : 0;
    make_groups();
    for (std::int64_t it = w0_; it < in_.target_iteration; ++it) {
      if (std::size_t(it - w0_) < w_) load_slot(std::size_t(it - w0_));
      const step_record& step = in_.steps->at(it);
      if (ep_ > 1) {  // every replica begins before any replays (replay_region's begin)
        for (std::size_t i = 0; i < all_; ++i) {
          engine::begin_operators(ops_[i]);
          replicas_[i]->begin_iteration(it);
        }
        if (in_.reduce) in_.experts_begin(it);
      }
      for (std::size_t d = 0; d < d_count_; ++d) replay_replica(d, it, step);
      if (in_.reduce && ep_ > 1) in_.experts_end(it);
      if (in_.reduce) reduce_with_group(it);
      for (int j = 0; j < k_; ++j) step_stage(j, step);
    }
    // t at the window's last slot: that slot is the state at t already.
    if (std::size_t(in_.target_iteration - w0_) < w_) {
      load_slot(std::size_t(in_.target_iteration - w0_));
    }
    if (active_ != n_all_) {
      throw conversion_error("sparse-to-dense: " + std::to_string(n_all_ - active_) +
                             " operators still frozen at the end (internal error)");
    }
    return rep_;
  }

  // The whole group is here (no `reduce`): each region stage's replicas in one engine::local_group,
  // which sums their gradients as training does and, under expert parallelism, lets each EP
  // group's replicas compute each other's expert rows.
  void make_groups() {
    if (in_.reduce) return;
    for (int j = 0; j < k_; ++j) {
      groups_.push_back(
          std::make_unique<engine::local_group>(replicas_.subspan(base(j), d_count_), ep_));
    }
  }

 private:
  int stage_of(std::size_t i) const { return in_.stage + int(i / d_count_); }
  // Replica 0 of stage `stage + j`.
  std::size_t base(int j) const { return std::size_t(j) * d_count_; }

  void check_region() {
    k_ = in_.region_stages;
    if (k_ < 1 || in_.stage < 0 || in_.stage + k_ > in_.stages) {
      throw conversion_error("sparse-to-dense: region of stages " + std::to_string(in_.stage) +
                             ".." + std::to_string(in_.stage + k_ - 1) +
                             " is outside the pipeline");
    }
    if (replicas_.empty() || replicas_.size() % std::size_t(k_) != 0) {
      throw conversion_error("sparse-to-dense: " + std::to_string(replicas_.size()) +
                             " stage models for a region of " + std::to_string(k_) + " stages");
    }
    d_count_ = replicas_.size() / std::size_t(k_);
    all_ = replicas_.size();
    if (in_.reduce && d_count_ != 1) {
      throw conversion_error(
          "sparse-to-dense: a parallel group replay gives one replica per stage");
    }
    ep_ = std::max(in_.train.expert_parallel, 1);
    if (ep_ > 1 && !in_.reduce && d_count_ != std::size_t(in_.train.data_parallel)) {
      throw conversion_error("sparse-to-dense: under expert parallelism (parallel.ep " +
                             std::to_string(ep_) +
                             ") a replay in one process gives the whole group");
    }
    if (ep_ > 1 && in_.reduce && (!in_.experts_begin || !in_.experts_end)) {
      throw conversion_error(
          "sparse-to-dense: under expert parallelism (parallel.ep " + std::to_string(ep_) +
          ") a member replaying its own replica needs experts_begin and experts_end");
    }
    if (ep_ > 1 && in_.reduce) {
      for (std::size_t i = 0; i < all_; ++i) {
        if (replicas_[i]->experts() == nullptr) {
          throw conversion_error(
              "sparse-to-dense: under expert parallelism a stage of the "
              "region holds no experts");
        }
      }
    }
    if (in_.windows.size() != all_) {
      throw conversion_error("sparse-to-dense: " + std::to_string(in_.windows.size()) +
                             " windows for " + std::to_string(all_) + " stage replicas");
    }
    if (in_.steps == nullptr) throw conversion_error("sparse-to-dense: no step plans given");
    starts_ = in_.stage == 0;
    ends_ = in_.stage + k_ == in_.stages;
    if (streamed()) {
      if (k_ != 1 || d_count_ != 1 || !in_.take_live || (in_.live_before && starts_) ||
          (in_.live_after && ends_)) {
        throw conversion_error(
            "sparse-to-dense: a pipelined replay gives one stage replica with live neighbours "
            "inside the pipeline, and take_live");
      }
    }
  }
  bool streamed() const { return in_.live_before || in_.live_after; }

  // Parses and verifies every slot before touching the stages.
  void parse_windows() {
    views_.resize(all_);
    ops_.resize(all_);
    from_initial_ = true;
    for (const auto& win : in_.windows) from_initial_ = from_initial_ && win.empty();
    for (std::size_t i = 0; i < all_; ++i) {
      ops_[i] = replicas_[i]->operators();
      if (from_initial_) {
        check_fresh(i);
        continue;
      }
      const std::size_t d = in_.first_replica + i % d_count_;
      const int s = stage_of(i);
      if (in_.windows[i].empty()) {
        throw conversion_error("sparse-to-dense: " + where(s, d) + " has an empty window");
      }
      for (std::size_t j = 0; j < in_.windows[i].size(); ++j) parse_slot(i, j, s, d);
      if (views_[i].size() != views_[0].size() ||
          views_[i][0].tag.state_iteration != views_[0][0].tag.state_iteration ||
          views_[i][0].tag.window != views_[0][0].tag.window) {
        throw conversion_error("sparse-to-dense: " + where(s, d) + " holds another window than " +
                               where(in_.stage, 0));
      }
    }
  }

  void parse_slot(std::size_t i, std::size_t j, int s, std::size_t d) {
    try {
      views_[i].push_back(parse_snapshot(in_.windows[i][j]));
    } catch (const snapshot_error& e) {
      throw snapshot_error("sparse-to-dense: slot " + std::to_string(j) + " of " + where(s, d) +
                           ": " + e.what());
    }
    const snapshot_tag& tag = views_[i].back().tag;
    const snapshot_tag& t0 = views_[i].front().tag;
    const bool other = i < in_.window_replicas.size() && in_.window_replicas[i] >= 0;
    const std::int32_t holder = other ? std::int32_t(in_.window_replicas[i]) : std::int32_t(d);
    if (tag.slot != j || tag.window != t0.window ||
        tag.state_iteration != t0.state_iteration + std::int64_t(j) || tag.stage != s ||
        tag.replica != holder) {
      throw conversion_error(
          "sparse-to-dense: slot " + std::to_string(j) + " of " + where(s, d) +
          " is tagged window " + std::to_string(tag.window) + " slot " + std::to_string(tag.slot) +
          " " + where(tag.stage, std::size_t(tag.replica)) + ": not the window asked for");
    }
    for (const auto& e : views_[i].back().entries) {
      if (e.index >= ops_[i].size()) {
        throw conversion_error("sparse-to-dense: slot " + std::to_string(j) + " names operator " +
                               std::to_string(e.index) + " of " + std::to_string(ops_[i].size()));
      }
    }
  }

  // A replay from the initial state needs every operator active (a fresh replica).
  void check_fresh(std::size_t i) const {
    for (const auto* op : ops_[i]) {
      if (op->mode() != models::op_mode::active) {
        throw conversion_error(
            "sparse-to-dense: a replay from the initial state needs fresh replicas, but " +
            op->name() + " is frozen");
      }
    }
  }

  void check_schedules() {
    w_ = from_initial_ ? 0 : views_[0].size();
    n_all_ = 0;
    for (int j = 0; j < k_; ++j) {
      n_all_ += ops_[base(j)].size();
      check_same_schedule(j);
      check_complete(j);
    }
  }

  // The recovery group must freeze the same operators, or the reduced gradients are wrong
  // (under expert parallelism: the replicas of one EP rank, which hold the same operators).
  void check_same_schedule(int j) const {
    for (std::size_t d = std::size_t(ep_); d < d_count_; ++d) {
      for (std::size_t sl = 0; sl < w_; ++sl) {
        const auto& a = views_[base(j) + d % std::size_t(ep_)][sl].entries;
        const auto& b = views_[base(j) + d][sl].entries;
        bool same = a.size() == b.size();
        for (std::size_t e = 0; same && e < a.size(); ++e) {
          same = a[e].index == b[e].index && a[e].mode == b[e].mode;
        }
        if (!same) {
          throw conversion_error("sparse-to-dense: " + where(in_.stage + j, d % std::size_t(ep_)) +
                                 " and replica " + std::to_string(d) + " scheduled slot " +
                                 std::to_string(sl) + " differently");
        }
      }
    }
  }

  // Every operator full in exactly one slot, with compute weights in every slot before it.
  void check_complete(int j) const {
    const auto& ops = ops_[base(j)];
    const std::size_t n = ops.size();
    std::vector<int> full_slot(n, from_initial_ ? 0 : -1);
    for (std::size_t sl = 0; sl < w_; ++sl) {
      std::vector<bool> present(n, false);
      for (const auto& e : views_[base(j)][sl].entries) {
        present[e.index] = true;
        if (e.mode != models::op_mode::active) continue;
        if (full_slot[e.index] >= 0) {
          throw conversion_error("sparse-to-dense: operator " + e.name + " is full in slots " +
                                 std::to_string(full_slot[e.index]) + " and " + std::to_string(sl));
        }
        full_slot[e.index] = int(sl);
      }
      for (std::size_t o = 0; o < n; ++o) {
        if (full_slot[o] < 0 && !present[o]) {
          throw conversion_error("sparse-to-dense: slot " + std::to_string(sl) +
                                 " has neither the state nor the compute weights of operator " +
                                 ops[o]->name());
        }
      }
    }
    for (std::size_t o = 0; o < n; ++o) {
      if (full_slot[o] < 0) {
        throw conversion_error("sparse-to-dense: the window never holds the full state of " +
                               ops[o]->name() + " (incomplete window)");
      }
    }
  }

  void check_range() {
    rep_.window = from_initial_ ? 0 : views_[0][0].tag.window;
    rep_.first_iteration = from_initial_ ? in_.initial_iteration : views_[0][0].tag.state_iteration;
    w0_ = rep_.first_iteration;
    const std::int64_t t = in_.target_iteration;
    if (t < w0_ + std::int64_t(w_) - 1) {
      throw conversion_error("sparse-to-dense: iteration " + std::to_string(t) +
                             " is inside the window starting at " + std::to_string(w0_) +
                             "; recover from the window before");
    }
    for (std::int64_t it = w0_; it < t; ++it) {
      if (!in_.steps->contains(it)) {
        throw conversion_error("sparse-to-dense: no step plan of iteration " + std::to_string(it));
      }
    }
    rep_.iterations_replayed = int(t - w0_);
  }

  void load_slot(std::size_t sl) {
    for (std::size_t i = 0; i < all_; ++i) {
      for (const auto& e : views_[i][sl].entries) load_operator(e, *ops_[i][e.index]);
      // the replay steps on the host: a GPU stage's device copy is reloaded when it next
      // steps there
      if (engine::device_state* d = replicas_[i]->device()) d->host_changed();
    }
    active_ = 0;
    for (int j = 0; j < k_; ++j) {
      for (const auto* op : ops_[base(j)]) {
        active_ += op->mode() == models::op_mode::active ? 1 : 0;
      }
    }
    rep_.active_after_slot.push_back(active_);
  }

  // Replays iteration `it` on replica d of every region stage, from the logged boundary inputs.
  void replay_replica(std::size_t d, std::int64_t it, const step_record& step) {
    if (streamed()) {
      replay_streamed(it, step);
      return;
    }
    const std::size_t floats = replicas_[0]->boundary_floats();
    const std::size_t gd = in_.first_replica + d;  // the replica's index in the group
    engine::replay_inputs ri{in_.stage, in_.stages, in_.micro_batches, {}, {}};
    for (int mb = 0; mb < in_.micro_batches; ++mb) {
      if (!starts_) {
        ri.activations.push_back(logged(d < in_.upstream.size() ? in_.upstream[d] : nullptr, it, mb,
                                        log_direction::activation, gd, in_.stage - 1, floats));
      }
      if (!ends_) {
        ri.gradients.push_back(logged(d < in_.downstream.size() ? in_.downstream[d] : nullptr, it,
                                      mb, log_direction::gradient, gd, in_.stage + k_, floats));
      }
    }
    std::vector<engine::stage_model*> region(std::size_t(k_), nullptr);
    for (int j = 0; j < k_; ++j) region[std::size_t(j)] = replicas_[base(j) + d];
    const auto outs = engine::replay_region(region, it, step.loss_grad, ri, ep_ == 1);
    for (int j = 0; j < k_; ++j) {
      if (active_ < n_all_) ++rep_.sparse_replays;
      const std::size_t i = base(j) + d;
      sent(in_.stage + j, it, gd, outs[std::size_t(j)], i < in_.own.size() ? in_.own[i] : nullptr);
    }
  }

  // The one stage of a pipelined replay: its boundary tensors with the region's other members
  // come live (take_live), the others from the logs; what it sends goes out at once.
  void replay_streamed(std::int64_t it, const step_record& step) {
    const std::size_t floats = replicas_[0]->boundary_floats();
    const std::size_t gd = in_.first_replica;
    const int s = in_.stage;
    const log_store* own = in_.own.empty() ? nullptr : in_.own[0];
    std::vector<float> act, grad;  // the inputs in use (valid until the next)
    auto input = [&](std::vector<float>& into, int mb,
                     log_direction dir) -> std::span<const float> {
      const bool activation = dir == log_direction::activation;
      if (activation ? in_.live_before : in_.live_after) {
        into = in_.take_live(it, mb, dir);
      } else {
        const log_store* log = activation ? (in_.upstream.empty() ? nullptr : in_.upstream[0])
                                          : (in_.downstream.empty() ? nullptr : in_.downstream[0]);
        into = logged(log, it, mb, dir, gd, activation ? s - 1 : s + 1, floats);
      }
      if (into.size() != floats) {
        throw conversion_error("sparse-to-dense: a live boundary tensor of iteration " +
                               std::to_string(it) + " micro-batch " + std::to_string(mb) + " has " +
                               std::to_string(into.size()) + " floats, expected " +
                               std::to_string(floats));
      }
      return into;
    };
    auto output = [&](int mb, log_direction dir, std::span<const float> t) {
      if (in_.on_sent) in_.on_sent(s, it, mb, dir, gd, t);
      check_sent(own, it, mb, dir, gd, t, rep_.tensors_checked);
    };
    engine::replay_stream io;
    io.activation_in = [&](int mb) { return input(act, mb, log_direction::activation); };
    io.gradient_in = [&](int mb) { return input(grad, mb, log_direction::gradient); };
    io.activation_out = [&](int mb, std::span<const float> t) {
      output(mb, log_direction::activation, t);
    };
    io.gradient_out = [&](int mb, std::span<const float> t) {
      output(mb, log_direction::gradient, t);
    };
    engine::replay_streamed(*replicas_[0], it, step.loss_grad, s, in_.stages, in_.micro_batches, io,
                            ep_ == 1);
    if (active_ < n_all_) ++rep_.sparse_replays;
  }

  // What stage s's replica gd sent in iteration `it`: to on_sent, and checked against its
  // own surviving log.
  void sent(int s, std::int64_t it, std::size_t gd, const engine::replay_outputs& out,
            const log_store* own) {
    const bool first = s == 0, last = s + 1 == in_.stages;
    for (int mb = 0; mb < in_.micro_batches; ++mb) {
      const auto m = std::size_t(mb);
      if (!last) {
        if (in_.on_sent) in_.on_sent(s, it, mb, log_direction::activation, gd, out.activations[m]);
        check_sent(own, it, mb, log_direction::activation, gd, out.activations[m],
                   rep_.tensors_checked);
      }
      if (!first) {
        if (in_.on_sent) in_.on_sent(s, it, mb, log_direction::gradient, gd, out.gradients[m]);
        check_sent(own, it, mb, log_direction::gradient, gd, out.gradients[m],
                   rep_.tensors_checked);
      }
    }
  }

  // The group's other replicas replay on other workers: one sum of every region stage's
  // gradients with theirs.
  void reduce_with_group(std::int64_t it) {
    if (ep_ > 1) {
      reduce_sharded(it);
      return;
    }
    std::size_t total = 0;
    for (int j = 0; j < k_; ++j) total += engine::gradient_floats(ops_[base(j)]);
    acc_.resize(total);
    std::size_t off = 0;
    for (int j = 0; j < k_; ++j) {
      const std::size_t n = engine::gradient_floats(ops_[base(j)]);
      engine::copy_gradients_out(ops_[base(j)], std::span(acc_).subspan(off, n));
      off += n;
    }
    in_.reduce(it, acc_);
    off = 0;
    for (int j = 0; j < k_; ++j) {
      const std::size_t n = engine::gradient_floats(ops_[base(j)]);
      engine::copy_gradients_in(ops_[base(j)], std::span<const float>(acc_).subspan(off, n));
      off += n;
    }
  }

  // Under expert parallelism: the non-experts of every region stage, then each source's part
  // of every region stage's expert block (group_layout); the block's sum comes back in the
  // first source's part.
  void reduce_sharded(std::int64_t it) {
    if (dense_ops_.empty()) {
      for (int j = 0; j < k_; ++j) {
        auto& dense = dense_ops_.emplace_back();
        for (auto* op : ops_[base(j)]) {
          if (op->kind() != models::op_kind::expert) dense.push_back(op);
        }
      }
      layout_ = group_layout_of(replicas_, ep_);
    }
    acc_.resize(layout_.floats());
    std::size_t off = 0;
    for (const auto& dense : dense_ops_) {
      const std::size_t n = engine::gradient_floats(dense);
      engine::copy_gradients_out(dense, std::span(acc_).subspan(off, n));
      off += n;
    }
    for (int s = 0; s < ep_; ++s) {
      for (int j = 0; j < k_; ++j) {
        const auto g = replicas_[base(j)]->experts()->source_gradient(s);
        std::copy(g.begin(), g.end(), acc_.begin() + std::ptrdiff_t(off));
        off += g.size();
      }
    }
    in_.reduce(it, acc_);
    off = 0;
    for (const auto& dense : dense_ops_) {
      const std::size_t n = engine::gradient_floats(dense);
      engine::copy_gradients_in(dense, std::span<const float>(acc_).subspan(off, n));
      off += n;
    }
    for (int j = 0; j < k_; ++j) {
      models::expert_shard* shard = replicas_[base(j)]->experts();
      const std::size_t n = shard->source_gradient(0).size();
      engine::copy_gradients_in(shard->experts(), std::span<const float>(acc_).subspan(off, n));
      off += n;
    }
  }

  void step_stage(int j, const step_record& step) {
    const std::size_t b = base(j);
    // The all-reduce as the engine does it: g_0 + g_1 + ... in replica order.
    if (!groups_.empty()) groups_[std::size_t(j)]->all_reduce();
    for (std::size_t d = 0; d < d_count_; ++d) {
      engine::apply_step(ops_[b + d], step.plan, in_.train);
    }
  }

  std::span<engine::stage_model* const> replicas_;
  const conversion_input& in_;
  int k_ = 1;                // stages in the region
  std::size_t d_count_ = 1;  // replicas of each stage given
  std::size_t all_ = 0;
  bool starts_ = false, ends_ = false, from_initial_ = true;
  std::vector<std::vector<snapshot_view>> views_;
  std::vector<std::vector<models::operator_state*>> ops_;
  std::size_t w_ = 0;      // slots in the window
  std::size_t n_all_ = 0;  // operators of the region (one replica of each stage)
  std::size_t active_ = 0;
  std::int64_t w0_ = 0;
  std::vector<float> acc_;
  int ep_ = 1;  // train.expert_parallel
  // A member replaying its own replica under expert parallelism: [region stage] its
  // non-expert operators, and what it hands `reduce`
  std::vector<std::vector<models::operator_state*>> dense_ops_;
  group_layout layout_;
  // [region stage]: its replicas, when the whole group replays here
  std::vector<std::unique_ptr<engine::local_group>> groups_;
  conversion_report rep_;
};

}  // namespace

group_layout group_layout_of(std::span<engine::stage_model* const> models, int ep) {
  group_layout l{0, 0, std::max(ep, 1)};
  for (engine::stage_model* model : models) {
    const auto ops = model->operators();
    for (models::operator_state* op : ops) {
      if (l.ep == 1 || op->kind() != models::op_kind::expert) {
        l.dense += engine::gradient_floats(std::span(&op, 1));
      }
    }
    if (l.ep > 1 && model->experts() != nullptr) {
      l.block += engine::gradient_floats(model->experts()->experts());
    }
  }
  return l;
}

void fold_group(const group_layout& l, std::size_t me, std::size_t d, std::span<const float> g,
                std::span<float> sum) {
  if (g.size() != l.floats() || sum.size() != l.dense + l.block || l.ep < 1) {
    throw std::invalid_argument("fold_group: gradients that do not fit the layout");
  }
  const auto ep = std::size_t(l.ep);
  const auto dense_in = g.first(l.dense);
  const auto dense_sum = sum.first(l.dense);
  if (d == 0) {
    std::copy(dense_in.begin(), dense_in.end(), dense_sum.begin());
  } else {
    engine::accumulate(dense_sum, dense_in);
  }
  if (l.ep == 1 || d % ep != me % ep) return;  // another EP rank's block
  // d's EP group holds sources d / ep * ep + s, in replica order
  const auto block_sum = sum.subspan(l.dense, l.block);
  for (std::size_t s = 0; s < ep; ++s) {
    const auto part = g.subspan(l.dense + s * l.block, l.block);
    if (d < ep && s == 0) {
      std::copy(part.begin(), part.end(), block_sum.begin());
    } else {
      engine::accumulate(block_sum, part);
    }
  }
}

conversion_report sparse_to_dense(std::span<engine::stage_model* const> replicas,
                                  const conversion_input& in) {
  return conversion(replicas, in).run();
}

}  // namespace moevement::recovery
