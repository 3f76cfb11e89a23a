#include "recovery/pec_capture.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <set>
#include <stdexcept>

#include "base/hash.hpp"

namespace moevement::recovery {

std::vector<moe_layer> find_moe_layers(std::span<const models::operator_state* const> ops,
                                       models::expert_split split) {
  std::vector<moe_layer> layers;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (ops[i]->kind() != models::op_kind::gate) continue;
    const int total = int(ops[i]->routed_tokens().size());
    if (split.count < 1 || total % split.count != 0) {
      throw std::invalid_argument(
          fmt::format("pec: gate {} routes to {} experts, which {} EP ranks do not share evenly",
                      ops[i]->name(), total, split.count));
    }
    moe_layer l{i, ops[i]->name(), {}, std::size_t(split.first(total)), std::size_t(total)};
    const std::size_t want = std::size_t(total / split.count);
    for (std::size_t j = i + 1; j < ops.size() && l.experts.size() < want; ++j) {
      if (ops[j]->kind() == models::op_kind::expert) l.experts.push_back(j);
    }
    if (l.experts.size() != want) {
      throw std::invalid_argument(fmt::format("pec: gate {} routes to {} experts, the stage has {}",
                                              l.name, want, l.experts.size()));
    }
    layers.push_back(std::move(l));
  }
  return layers;
}

pec_schedule::pec_schedule(int experts, pec_selection order, int interval,
                           std::span<models::operator_state* const> ops, models::expert_split split)
    : k_(experts), order_(order), interval_(interval), n_(ops.size()) {
  if (experts < 1) throw std::invalid_argument("checkpoint.pec_experts: must be >= 1");
  if (split.count > 1 && order == pec_selection::load_aware) {
    throw std::invalid_argument(
        "checkpoint.pec_order: load-aware ranks every expert of a layer, which an expert-"
        "parallel worker does not count; use \"sequential\" with parallel.ep > 1");
  }
  if (interval < 1) {
    throw std::invalid_argument(
        "pec: interval must be >= 1 (resolve checkpoint.interval = 0 with resolve_interval)");
  }
  const std::vector<const models::operator_state*> cops(ops.begin(), ops.end());
  layers_ = find_moe_layers(cops, split);
  layer_of_.assign(n_, -1);
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    for (auto e : layers_[l].experts) layer_of_[e] = int(l);
  }
  saved_at_.assign(n_, 0);
  prev_saved_at_.assign(n_, 0);
}

void pec_schedule::add_counts(std::int64_t iteration,
                              std::span<models::operator_state* const> ops) {
  if (ops.size() != n_) throw std::invalid_argument("pec: the stage's operator count changed");
  if (iteration < first_count_kept_) return;  // a range no recovery can ask for any more
  auto& c = counts_[iteration];
  c.resize(n_, 0);
  for (const auto& l : layers_) {
    const auto& routed = ops[l.gate]->routed_tokens();
    for (std::size_t j = 0; j < l.experts.size(); ++j) c[l.experts[j]] += routed[l.first + j];
  }
}

void pec_schedule::add_popularity(std::int64_t iteration, std::span<const double> popularity) {
  if (popularity.size() != n_) {
    throw std::invalid_argument(
        fmt::format("pec: {} popularity counts for {} operators", popularity.size(), n_));
  }
  if (iteration < first_count_kept_) return;
  auto& c = counts_[iteration];
  c.resize(n_, 0);
  for (std::size_t i = 0; i < n_; ++i) {
    if (layer_of_[i] >= 0) c[i] += std::int64_t(popularity[i]);
  }
}

std::vector<std::int64_t> pec_schedule::unsaved_tokens(std::int64_t to) const {
  std::vector<std::int64_t> out(n_, 0);
  for (std::size_t i = 0; i < n_; ++i) {
    if (layer_of_[i] >= 0 && saved_at_[i] < to) out[i] = routed_tokens(i, saved_at_[i], to);
  }
  return out;
}

void pec_schedule::restart(std::int64_t c, std::span<const std::int64_t> saved_at,
                           std::span<const std::int64_t> unsaved) {
  if (saved_at.size() != n_ || unsaved.size() != n_) {
    throw std::invalid_argument("pec: restart with counts of another stage");
  }
  saved_at_.assign(saved_at.begin(), saved_at.end());
  prev_saved_at_ = saved_at_;
  counts_.clear();
  selections_.clear();
  first_count_kept_ = 0;
  // What each stale expert missed since its save, as one count just before c: every later
  // routed_tokens(e, saved_at[e], t > c) includes it.
  if (c > 0) counts_[c - 1].assign(unsaved.begin(), unsaved.end());
}

std::int64_t pec_schedule::routed_tokens(std::size_t op, std::int64_t from, std::int64_t to) const {
  if (op >= n_ || layer_of_[op] < 0) {
    throw std::out_of_range(fmt::format("pec: operator {} is not a routed expert", op));
  }
  if (from < first_count_kept_) {
    throw std::out_of_range(
        fmt::format("pec: routed-token counts from iteration {} were dropped (kept from {})", from,
                    first_count_kept_));
  }
  std::int64_t sum = 0;
  for (auto it = counts_.lower_bound(from); it != counts_.end() && it->first < to; ++it) {
    sum += it->second[op];
  }
  return sum;
}

const std::vector<capture_kind>& pec_schedule::checkpoint_kinds(std::int64_t iteration) {
  if (auto it = selections_.find(iteration); it != selections_.end()) return it->second;
  if (!is_checkpoint(iteration)) {
    throw std::invalid_argument(fmt::format(
        "pec: iteration {} is not a checkpoint point of interval {}", iteration, interval_));
  }
  if (!selections_.empty() && selections_.rbegin()->first > iteration) {
    throw std::logic_error(fmt::format("pec: checkpoint of iteration {} asked after that of {}",
                                       iteration, selections_.rbegin()->first));
  }
  std::vector<capture_kind> kinds(n_, capture_kind::full);
  const std::int64_t number = (iteration + 1) / interval_ - 1;  // 0-based checkpoint number
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const auto& experts = layers_[l].experts;
    // Over the layer's experts (all ranks'), held or not: every EP rank selects alike.
    const std::size_t e = layers_[l].total;
    if (e == 0) continue;
    const std::size_t keep = std::min<std::size_t>(std::size_t(k_), e);
    const std::size_t start = std::size_t((number * k_ + std::int64_t(l)) % std::int64_t(e));
    // by_rank[r]: the layer's expert that comes r-th in this checkpoint's sequential order
    std::vector<std::size_t> by_rank(e);
    for (std::size_t r = 0; r < e; ++r) by_rank[r] = (start + r) % e;
    if (order_ == pec_selection::load_aware) {  // (every expert held: no EP)
      std::vector<std::int64_t> unsaved(e);
      for (std::size_t j = 0; j < e; ++j) {
        unsaved[j] = routed_tokens(experts[j], saved_at_[experts[j]], iteration);
      }
      // most unsaved tokens first; stable, so ties keep the sequential order
      std::stable_sort(by_rank.begin(), by_rank.end(),
                       [&](std::size_t a, std::size_t b) { return unsaved[a] > unsaved[b]; });
    }
    for (std::size_t r = keep; r < e; ++r) {
      const std::size_t x = by_rank[r];
      if (x >= layers_[l].first && x - layers_[l].first < experts.size()) {
        kinds[experts[x - layers_[l].first]] = capture_kind::skip;
      }
    }
  }
  prev_saved_at_ = saved_at_;
  for (std::size_t i = 0; i < n_; ++i) {
    if (kinds[i] == capture_kind::full) saved_at_[i] = iteration + 1;
  }
  // Counts older than every expert's save before this checkpoint can no longer be asked for.
  std::int64_t oldest = iteration + 1;
  for (std::size_t i = 0; i < n_; ++i) {
    if (layer_of_[i] >= 0) oldest = std::min(oldest, prev_saved_at_[i]);
  }
  first_count_kept_ = oldest;
  counts_.erase(counts_.begin(), counts_.lower_bound(oldest));
  while (selections_.size() > 1) selections_.erase(selections_.begin());
  return selections_[iteration] = std::move(kinds);
}

pec_capture::pec_capture(pec_schedule& schedule, int stage, int replica,
                         const models::loss_scaler* scaler)
    : schedule_(schedule),
      stage_(stage),
      replica_(replica),
      scaler_(scaler),
      latest_(schedule.operators(), 0),
      prev_latest_(schedule.operators(), 0) {}

void pec_capture::after_step(std::int64_t iteration, std::span<models::operator_state* const> ops) {
  if (ops.size() != schedule_.operators()) {
    throw std::invalid_argument(
        fmt::format("pec capture: stage {} has {} operators, the "
                    "schedule {}",
                    stage_, ops.size(), schedule_.operators()));
  }
  if (popularity_.empty()) {
    schedule_.add_counts(iteration, ops);
  } else {
    schedule_.add_popularity(iteration, popularity_);
    popularity_.clear();
  }
  if (!schedule_.is_checkpoint(iteration)) return;
  const auto t0 = std::chrono::steady_clock::now();
  const auto& kinds = schedule_.checkpoint_kinds(iteration);
  const std::vector<const models::operator_state*> cops(ops.begin(), ops.end());
  std::vector<std::byte> buf;
  if (!spare_.empty()) {
    buf = std::move(spare_.back());
    spare_.pop_back();
  }
  buf.resize(snapshot_size(cops, kinds));
  const models::loss_scaler scaler = scaler_ ? *scaler_ : models::loss_scaler{};
  const std::int64_t state = iteration + 1;
  write_snapshot(buf, {std::uint64_t(state / schedule_.interval()), 0, state, stage_, replica_},
                 scaler, cops, kinds);
  last_bytes_ = buf.size();
  held_[state] = std::move(buf);
  prev_latest_ = latest_;
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    if (kinds[i] == capture_kind::full) latest_[i] = state;
  }
  // keep what is some operator's newest save, as of this checkpoint or the one before
  std::set<std::int64_t> needed(latest_.begin(), latest_.end());
  needed.insert(prev_latest_.begin(), prev_latest_.end());
  for (auto it = held_.begin(); it != held_.end();) {
    if (needed.count(it->first) != 0) {
      ++it;
      continue;
    }
    if (spare_.size() < 2) spare_.push_back(std::move(it->second));
    it = held_.erase(it);
  }
  ++checkpoints_;
  last_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void pec_capture::restart(std::map<std::int64_t, std::vector<std::byte>> held,
                          std::vector<std::int64_t> latest) {
  if (latest.size() != schedule_.operators()) {
    throw std::invalid_argument("pec capture: restart with another stage's operators");
  }
  held_ = std::move(held);
  latest_ = std::move(latest);
  prev_latest_ = latest_;
}

std::vector<pec_checkpoint_view> pec_capture::held() const {
  std::vector<pec_checkpoint_view> out;
  for (const auto& [it, bytes] : held_) out.push_back({it, bytes});
  return out;
}

std::optional<std::int64_t> pec_capture::newest() const {
  if (held_.empty()) return std::nullopt;
  return held_.rbegin()->first;
}

std::size_t pec_capture::bytes_held() const {
  std::size_t n = 0;
  for (const auto& [it, b] : held_) n += b.capacity();
  for (const auto& b : spare_) n += b.capacity();
  return n;
}

// ---- the trailer

namespace {
constexpr char pec_meta_magic[8] = {'M', 'V', 'P', 'E', 'C', 'M', '0', '1'};
}  // namespace

std::vector<std::byte> encode_pec_meta(const pec_meta& meta) {
  if (meta.saved_at.size() != meta.unsaved.size()) {
    throw std::invalid_argument("pec meta: saved_at and unsaved differ in length");
  }
  const std::uint32_t n = static_cast<std::uint32_t>(meta.saved_at.size());
  std::vector<std::byte> out(sizeof(pec_meta_magic) + 4 + 16 * std::size_t(n) + 8);
  std::byte* p = out.data();
  std::memcpy(p, pec_meta_magic, sizeof(pec_meta_magic));
  p += sizeof(pec_meta_magic);
  std::memcpy(p, &n, 4);
  p += 4;
  std::memcpy(p, meta.saved_at.data(), 8 * std::size_t(n));
  p += 8 * std::size_t(n);
  std::memcpy(p, meta.unsaved.data(), 8 * std::size_t(n));
  p += 8 * std::size_t(n);
  const std::uint64_t h =
      xxhash64(std::span<const std::byte>(out.data(), std::size_t(p - out.data())));
  std::memcpy(p, &h, 8);
  return out;
}

pec_meta decode_pec_meta(std::span<const std::byte> bytes, std::size_t ops) {
  const std::size_t want = sizeof(pec_meta_magic) + 4 + 16 * ops + 8;
  if (bytes.size() != want) {
    throw snapshot_error(fmt::format("pec trailer of {} bytes, {} expected for {} operators",
                                     bytes.size(), want, ops));
  }
  if (std::memcmp(bytes.data(), pec_meta_magic, sizeof(pec_meta_magic)) != 0) {
    throw snapshot_error("pec trailer: bad magic");
  }
  std::uint64_t h = 0;
  std::memcpy(&h, bytes.data() + want - 8, 8);
  if (h != xxhash64(bytes.first(want - 8))) throw snapshot_error("pec trailer: checksum mismatch");
  std::uint32_t n = 0;
  std::memcpy(&n, bytes.data() + sizeof(pec_meta_magic), 4);
  if (n != ops) throw snapshot_error("pec trailer: operator count mismatch");
  pec_meta m;
  m.saved_at.resize(ops);
  m.unsaved.resize(ops);
  const std::byte* p = bytes.data() + sizeof(pec_meta_magic) + 4;
  std::memcpy(m.saved_at.data(), p, 8 * ops);
  std::memcpy(m.unsaved.data(), p + 8 * ops, 8 * ops);
  return m;
}

}  // namespace moevement::recovery
