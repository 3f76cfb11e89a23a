#include "recovery/baseline_recovery.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>

namespace moevement::recovery {
namespace {

// One snapshot a stage could be restored from; fetch reads it (throws with the reason).
struct candidate {
  std::int64_t iteration = 0;
  std::string origin;
  std::function<std::vector<std::byte>()> fetch;
};

// Why `view` cannot restore stage s at `iteration` (-1: any) into ops, or "" when it can.
std::string unfit(const snapshot_view& view, int s, std::int64_t iteration,
                  std::span<models::operator_state* const> ops) {
  if (view.tag.stage != s) return fmt::format("it is stage {}'s snapshot", view.tag.stage);
  if (iteration >= 0 && view.tag.state_iteration != iteration) {
    return fmt::format("it holds iteration {}, not {}", view.tag.state_iteration, iteration);
  }
  if (view.entries.size() != ops.size()) {
    return fmt::format("{} operators in it, the stage has {} (not a full snapshot of this model)",
                       view.entries.size(), ops.size());
  }
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const auto& e = view.entries[i];
    if (e.index != i || e.mode != models::op_mode::active || e.name != ops[i]->name() ||
        e.numel != std::uint64_t(ops[i]->numel())) {
      return fmt::format("entry {} ({}) does not match operator {} in full", i, e.name,
                         ops[i]->name());
    }
  }
  return "";
}

rollback_report rollback(engine::local_pipeline& pipe,
                         std::vector<std::vector<candidate>> by_stage) {
  rollback_report rep;
  const int stages = pipe.stages();
  std::set<std::int64_t, std::greater<>> iterations;
  for (int s = 0; s < stages; ++s) {
    if (by_stage[std::size_t(s)].empty()) {
      throw rollback_error(fmt::format(
          "global rollback: stage {} has no snapshot at all; restart the job from iteration 0", s));
    }
    for (const auto& c : by_stage[std::size_t(s)]) iterations.insert(c.iteration);
  }
  for (const std::int64_t it : iterations) {
    std::vector<std::vector<std::byte>> chosen(static_cast<std::size_t>(stages));
    std::vector<snapshot_view> views(static_cast<std::size_t>(stages));
    bool all = true;
    for (int s = 0; s < stages && all; ++s) {
      bool found = false;
      for (const auto& c : by_stage[std::size_t(s)]) {
        if (c.iteration != it) continue;
        try {
          auto bytes = c.fetch();
          auto view = parse_snapshot(bytes);
          if (const auto why = unfit(view, s, it, pipe.stage(s, 0).operators()); !why.empty()) {
            throw snapshot_error(why);
          }
          chosen[std::size_t(s)] = std::move(bytes);
          // the views point into chosen[s]'s heap buffer, which the move kept
          views[std::size_t(s)] = std::move(view);
          if (rep.sources.size() <= std::size_t(s)) rep.sources.resize(std::size_t(s) + 1);
          rep.sources[std::size_t(s)] = c.origin;
          found = true;
          break;
        } catch (const std::exception& e) {
          rep.rejected.push_back(fmt::format("{}: {}", c.origin, e.what()));
        }
      }
      all = found;
    }
    if (!all) continue;
    const models::loss_scaler scaler = views[0].scaler;
    for (int s = 1; s < stages; ++s) {
      const auto& o = views[std::size_t(s)].scaler;
      if (o.enabled != scaler.enabled || o.scale != scaler.scale ||
          o.good_steps != scaler.good_steps || o.window != scaler.window) {
        throw rollback_error(fmt::format(
            "global rollback: the snapshots of iteration {} disagree on the loss scaler (stage "
            "0 and stage {}): they are not of one job",
            it, s));
      }
    }
    for (int s = 0; s < stages; ++s) {
      for (int d = 0; d < pipe.replicas(); ++d) {
        const auto ops = pipe.stage(s, d).operators();
        for (std::size_t i = 0; i < ops.size(); ++i) {
          load_operator(views[std::size_t(s)].entries[i], *ops[i]);
        }
      }
      rep.bytes_loaded += chosen[std::size_t(s)].size();
    }
    pipe.set_position(it, scaler);
    rep.iteration = it;
    return rep;
  }
  std::string why;
  for (const auto& r : rep.rejected) why += "\n  " + r;
  throw rollback_error(
      fmt::format("global rollback: no iteration has a verified full snapshot of every stage{}{}",
                  why, why.empty() ? " (no common iteration)" : ""));
}

}  // namespace

restored_snapshot restore_full_snapshot(std::span<const std::byte> bytes, int stage,
                                        std::int64_t iteration,
                                        std::span<engine::stage_model* const> replicas) {
  const auto view = parse_snapshot(bytes);
  for (auto* replica : replicas) {
    if (const auto why = unfit(view, stage, iteration, replica->operators()); !why.empty()) {
      throw snapshot_error(fmt::format("snapshot cannot restore stage {}: {}", stage, why));
    }
  }
  for (auto* replica : replicas) {
    const engine::host_write_scope writing(*replica);  // a GPU stage's state, synced around
    const auto ops = replica->operators();
    for (std::size_t i = 0; i < ops.size(); ++i) load_operator(view.entries[i], *ops[i]);
  }
  return {view.tag, view.scaler};
}

rollback_report rollback_from_memory(engine::local_pipeline& pipe,
                                     std::span<const dense_capture* const> captures) {
  std::vector<std::vector<candidate>> by_stage(std::size_t(pipe.stages()));
  for (const dense_capture* cap : captures) {
    if (cap == nullptr || cap->stage() < 0 || cap->stage() >= pipe.stages()) continue;
    for (const auto& snap : cap->held()) {
      by_stage[std::size_t(cap->stage())].push_back(
          {snap.iteration,
           fmt::format("host memory of stage {} replica {}, iteration {}", cap->stage(),
                       cap->replica(), snap.iteration),
           [bytes = snap.bytes] { return std::vector<std::byte>(bytes.begin(), bytes.end()); }});
    }
  }
  return rollback(pipe, std::move(by_stage));
}

rollback_report rollback_from_disk(engine::local_pipeline& pipe, const std::filesystem::path& dir) {
  if (!std::filesystem::is_directory(dir)) {
    throw rollback_error(fmt::format(
        "global rollback: checkpoint directory {} does not exist (checkpoint.dir)", dir.string()));
  }
  std::vector<std::vector<candidate>> by_stage(std::size_t(pipe.stages()));
  for (int s = 0; s < pipe.stages(); ++s) {
    for (int d = 0; d < pipe.replicas(); ++d) {
      const auto rdir = replica_dir(dir, s, d);
      if (!std::filesystem::is_directory(rdir)) continue;
      auto store = std::make_shared<durable_store>(rdir);
      const auto ids = store->windows();
      for (auto id = ids.rbegin(); id != ids.rend(); ++id) {
        by_stage[std::size_t(s)].push_back({std::int64_t(*id),
                                            fmt::format("{} window {}", rdir.string(), *id),
                                            [store, wid = *id] {
                                              auto w = store->load(wid);
                                              if (!w.ok()) throw snapshot_error(w.err().message);
                                              auto blob = w->blobs.find("snapshot");
                                              if (blob == w->blobs.end())
                                                throw snapshot_error("no blob named snapshot");
                                              return std::move(blob->second);
                                            }});
      }
    }
  }
  return rollback(pipe, std::move(by_stage));
}

namespace {

// PEC's restore of one stage: its checkpoints up to c parsed, and each operator's newest save
// there (nullptr: never saved, the initial state).
struct pec_stage_plan {
  std::vector<std::vector<std::byte>> keep;  // parsed checkpoints' bytes (views point here)
  std::vector<const snapshot_entry*> entry;  // [op]: its newest save <= c (nullptr: initial)
  std::vector<snapshot_view> views;
};

// Per stage: the surviving replica with the newest checkpoint.
std::vector<const pec_capture*> newest_pec_sources(std::span<const pec_capture* const> captures,
                                                   int stages) {
  std::vector<const pec_capture*> source(static_cast<std::size_t>(stages), nullptr);
  for (const pec_capture* cap : captures) {
    if (cap == nullptr || cap->stage() < 0 || cap->stage() >= stages || !cap->newest()) continue;
    auto& cur = source[std::size_t(cap->stage())];
    if (cur == nullptr || *cap->newest() > *cur->newest()) cur = cap;
  }
  return source;
}

// Parses and checks stage s's checkpoints up to c before any operator is touched; sets
// `scaler` from stage 0's checkpoint c.
pec_stage_plan plan_pec_stage(engine::local_pipeline& fresh, const pec_capture& cap, int s,
                              std::int64_t c, std::optional<models::loss_scaler>& scaler) {
  pec_stage_plan plan;
  const auto ops = fresh.stage(s, 0).operators();
  if (ops.size() != cap.schedule().operators()) {
    throw rollback_error(fmt::format("pec recovery: stage {} has {} operators, its checkpoints {}",
                                     s, ops.size(), cap.schedule().operators()));
  }
  const auto held = cap.held();
  if (std::none_of(held.begin(), held.end(), [&](const auto& h) { return h.iteration == c; })) {
    throw rollback_error(fmt::format(
        "pec recovery: stage {} no longer holds checkpoint {} (stages' newest differ by more "
        "than one checkpoint)",
        s, c));
  }
  for (const auto& h : held) {
    if (h.iteration <= c) plan.keep.emplace_back(h.bytes.begin(), h.bytes.end());
  }
  plan.views.reserve(plan.keep.size());
  for (const auto& bytes : plan.keep) {
    try {
      plan.views.push_back(parse_snapshot(bytes));
    } catch (const snapshot_error& e) {
      throw rollback_error(fmt::format("pec recovery: stage {}'s checkpoint: {}", s, e.what()));
    }
  }
  plan.entry.assign(ops.size(), nullptr);
  for (const auto& v : plan.views) {  // oldest first: newer saves overwrite
    if (v.tag.stage != s) {
      throw rollback_error(
          fmt::format("pec recovery: stage {} holds stage {}'s checkpoint", s, v.tag.stage));
    }
    for (const auto& e : v.entries) {
      if (e.index >= ops.size() || e.mode != models::op_mode::active) {
        throw rollback_error(fmt::format("pec recovery: stage {} checkpoint {}: bad entry {}", s,
                                         v.tag.state_iteration, e.name));
      }
      plan.entry[e.index] = &e;
    }
    if (v.tag.state_iteration == c && s == 0) scaler = v.scaler;
  }
  const auto& newest = plan.views.back();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const bool expert = ops[i]->kind() == models::op_kind::expert;
    const snapshot_entry* e = plan.entry[i];
    if (!expert && (e == nullptr || newest.tag.state_iteration != c ||
                    std::none_of(newest.entries.begin(), newest.entries.end(),
                                 [&](const auto& x) { return x.index == i; }))) {
      throw rollback_error(fmt::format(
          "pec recovery: non-expert {} of stage {} is not in checkpoint {}", ops[i]->name(), s, c));
    }
    if (e != nullptr) continue;
    for (int d = 0; d < fresh.replicas(); ++d) {
      if (fresh.stage(s, d).operators()[i]->step() != 0) {
        throw rollback_error(
            fmt::format("pec recovery: expert {} of stage {} was never saved and replica {} is not "
                        "freshly built: pass a fresh job",
                        ops[i]->name(), s, d));
      }
    }
  }
  return plan;
}

// Loads stage s's plan into every replica, and counts what its stale experts lost.
void load_pec_stage(engine::local_pipeline& fresh, const pec_capture& cap, int s,
                    const pec_stage_plan& plan, std::int64_t c, pec_recovery_report& rep) {
  for (int d = 0; d < fresh.replicas(); ++d) {
    const auto ops = fresh.stage(s, d).operators();
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (plan.entry[i] != nullptr) load_operator(*plan.entry[i], *ops[i]);
    }
  }
  // the state iteration each operator's save holds (0: initial)
  std::map<const snapshot_entry*, std::int64_t> when;
  for (const auto& v : plan.views) {
    for (const auto& e : v.entries) when[&e] = v.tag.state_iteration;
  }
  for (const auto& layer : cap.schedule().layers()) {
    std::int64_t lost = 0;
    for (auto e : layer.experts) {
      const std::int64_t saved = plan.entry[e] ? when.at(plan.entry[e]) : 0;
      if (saved < c) {
        ++rep.stale_experts;
        lost += cap.schedule().routed_tokens(e, saved, c);
      }
    }
    rep.layers.push_back(layer.name);
    rep.lost_tokens.push_back(lost);
  }
}

}  // namespace

pec_recovery_report recover_pec(engine::local_pipeline& fresh,
                                std::span<const pec_capture* const> captures,
                                std::int64_t failed_at, const models::model_config& model,
                                const models::train_config& train) {
  const int stages = fresh.stages();
  const auto source = newest_pec_sources(captures, stages);
  std::int64_t c = failed_at;
  for (int s = 0; s < stages; ++s) {
    if (source[std::size_t(s)] == nullptr) {
      throw rollback_error(fmt::format(
          "pec recovery: stage {} has no PEC checkpoint; restart the job from iteration 0", s));
    }
    c = std::min(c, *source[std::size_t(s)]->newest());
  }
  if (c > failed_at) {
    throw rollback_error(
        fmt::format("pec recovery: checkpoint {} is after the failure at {}", c, failed_at));
  }
  pec_recovery_report rep;
  rep.iteration = c;
  rep.failed_at = failed_at;
  rep.tokens_per_layer = std::int64_t(train.micro_batches) * train.micro_batch_size *
                         train.seq_len * train.data_parallel * model.top_k * failed_at;
  std::optional<models::loss_scaler> scaler;
  // parse and plan every stage before touching any operator
  std::vector<pec_stage_plan> plans;
  for (int s = 0; s < stages; ++s) {
    plans.push_back(plan_pec_stage(fresh, *source[std::size_t(s)], s, c, scaler));
  }
  for (int s = 0; s < stages; ++s) {
    load_pec_stage(fresh, *source[std::size_t(s)], s, plans[std::size_t(s)], c, rep);
  }
  fresh.set_position(c, *scaler);
  double sum = 0.0;
  for (auto lost : rep.lost_tokens) {
    sum += rep.tokens_per_layer > 0 ? double(lost) / double(rep.tokens_per_layer) : 0.0;
  }
  rep.plt = rep.lost_tokens.empty() ? 0.0 : sum / double(rep.lost_tokens.size());
  return rep;
}

double proportion_of_lost_tokens(std::span<const std::int64_t> lost_tokens_all_faults,
                                 int moe_layers, std::int64_t run_tokens, int top_k) {
  if (moe_layers < 1 || run_tokens < 1 || top_k < 1) {
    throw std::invalid_argument("proportion_of_lost_tokens: layers, tokens and top_k must be >= 1");
  }
  double lost = 0.0;
  for (auto n : lost_tokens_all_faults) lost += double(n);
  return lost / (double(moe_layers) * double(run_tokens) * double(top_k));
}

}  // namespace moevement::recovery
