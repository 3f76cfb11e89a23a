#include "recovery/layout_change.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "recovery/durable_window.hpp"
#include "recovery/snapshot.hpp"
#include "recovery/sparse_to_dense.hpp"

namespace moevement::recovery {
namespace {

// Copies one operator's full training state (master, m, v, step; the compute weights follow)
// through the snapshot format, which checks name and size.
void copy_operator(const models::operator_state& from, models::operator_state& to) {
  const models::operator_state* const one[] = {&from};
  const capture_kind kinds[] = {capture_kind::full};
  std::vector<std::byte> bytes(snapshot_size(one, kinds));
  write_snapshot(bytes, snapshot_tag{}, models::loss_scaler{}, one, kinds);
  load_operator(parse_snapshot(bytes).entries.at(0), to);
}

}  // namespace

std::unique_ptr<engine::stage_model> restore_across_layouts(const layout_restore& in,
                                                            const engine::stage_factory& factory,
                                                            const engine::stage_setup& setup) {
  const int pp = in.from.stages, dp = in.from.replicas, ep = std::max(in.from.ep, 1);
  const int mbs = setup.train.micro_batches;
  // The window's layout, every stage replica (index s * dp + d), from its files.
  std::vector<std::unique_ptr<engine::stage_model>> old;
  std::vector<std::vector<std::vector<std::byte>>> files;
  conversion_input conv;
  for (int s = 0; s < pp; ++s) {
    for (int d = 0; d < dp; ++d) {
      engine::stage_setup sd = setup;
      sd.stage = s;
      sd.stages = pp;
      sd.replica = d;
      sd.replicas = dp;
      sd.train.data_parallel = dp;
      sd.train.expert_parallel = ep;
      sd.initialize = false;  // the window overwrites every operator
      old.push_back(factory(sd));
      auto loaded =
          load_durable_window(durable_store(durable_window_dir(in.root, s, d)), in.window, s, d);
      // Replicas of a stage hold the same bits (those of one EP shard): where this one's files
      // are gone or fail their checks (a replica fenced for silent corruption leaves none),
      // another's serve.
      for (int o = 0; o < dp && !loaded.ok(); ++o) {
        if (o == d || o % ep != d % ep) continue;
        auto other =
            load_durable_window(durable_store(durable_window_dir(in.root, s, o)), in.window, s, o);
        if (!other.ok()) continue;
        std::fprintf(stderr,
                     "stage %d replica %d of the windows: durable window %llu from replica %d's "
                     "files (its own: %s)\n",
                     s, d, static_cast<unsigned long long>(in.window), o,
                     loaded.err().message.c_str());
        loaded = std::move(other);
      }
      if (!loaded.ok()) {
        throw std::runtime_error(
            fmt::format("durable window of stage {} replica {} (pp={} dp={}): {}", s, d, pp, dp,
                        loaded.err().message));
      }
      if (loaded->meta.first_iteration != in.first_iteration ||
          loaded->meta.w_sparse != in.w_sparse) {
        throw std::runtime_error(fmt::format(
            "durable window {} of stage {} replica {} replays from iteration {} with W={}, the "
            "journal says {} and {}",
            in.window, s, d, loaded->meta.first_iteration, loaded->meta.w_sparse,
            in.first_iteration, in.w_sparse));
      }
      files.push_back(std::move(loaded->slots));
      // Whose copies these are: their tags name that replica.
      conv.window_replicas.push_back(loaded->meta.replica != d ? loaded->meta.replica : -1);
    }
  }
  for (const auto& f : files) {
    auto& spans = conv.windows.emplace_back();
    for (const auto& slot : f) spans.emplace_back(slot);
  }
  // The whole pipeline replays: stage 0 reads the data, the last computes its loss, and no
  // boundary log is needed (the empty logs stand for "none").
  std::vector<log_store> none(static_cast<std::size_t>(dp));
  for (auto& l : none) {
    conv.upstream.push_back(&l);
    conv.downstream.push_back(&l);
  }
  std::map<std::int64_t, step_record> steps;
  for (const auto& [it, s] : in.steps) {
    steps[it] = step_record{s.loss_scale / float(mbs * dp), s.plan};  // the old dp's mean
  }
  conv.stage = 0;
  conv.region_stages = pp;
  conv.stages = pp;
  conv.micro_batches = mbs;
  conv.target_iteration = in.target_iteration;
  conv.steps = &steps;
  conv.train = setup.train;
  conv.train.data_parallel = dp;
  conv.train.expert_parallel = ep;
  conv.initial_iteration = in.first_iteration;
  std::vector<engine::stage_model*> ptrs;
  for (auto& m : old) ptrs.push_back(m.get());
  (void)sparse_to_dense(ptrs, conv);

  // This job's stage: each operator from the old stage that had it, from the first replica
  // that holds it (the replicas are equal after every step; under expert parallelism each
  // holds its EP rank's block of experts).
  std::map<std::string, const models::operator_state*> by_name;
  for (int s = 0; s < pp; ++s) {
    for (int d = 0; d < dp; ++d) {
      for (const auto* op : old[std::size_t(s * dp + d)]->operators()) {
        if (op->allocated()) by_name.emplace(op->name(), op);
      }
    }
  }
  engine::stage_setup mine = setup;
  mine.initialize = false;
  auto out = factory(mine);
  for (auto* op : out->operators()) {
    const auto from = by_name.find(op->name());
    if (from == by_name.end()) {
      throw std::runtime_error(fmt::format(
          "operator {} of stage {} is in no stage of the window's layout (pp={} dp={} ep={})",
          op->name(), setup.stage, pp, dp, ep));
    }
    copy_operator(*from->second, *op);
  }
  if (engine::device_state* d = out->device()) d->host_changed();
  return out;
}

}  // namespace moevement::recovery
