#include "recovery/resume_journal.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <charconv>
#include <sstream>

#include "base/parse.hpp"
#include "recovery/durable_store.hpp"

namespace moevement::recovery {
namespace {

constexpr const char* blob_name = "resume.txt";
// Bounds on what a journal may hold: a damaged file must not ask for a huge allocation.
constexpr std::size_t max_lines = 1u << 22;
constexpr std::size_t max_identity_value = 4096;

bool parse_f32(const std::string& s, float& out) {
  std::uint32_t bits = 0;
  if (s.size() != 8 || !parse_int(s, bits, 16)) return false;
  out = std::bit_cast<float>(bits);
  return true;
}

bool parse_f64(const std::string& s, double& out) {
  std::uint64_t bits = 0;
  if (s.size() != 16 || !parse_int(s, bits, 16)) return false;
  out = std::bit_cast<double>(bits);
  return true;
}

std::string bits(float v) {
  return fmt::format("{:08x}", std::bit_cast<std::uint32_t>(v));
}
std::string bits(double v) {
  return fmt::format("{:016x}", std::bit_cast<std::uint64_t>(v));
}

std::vector<std::string> words(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(std::move(w));
  return out;
}

// Line n (2..6) of a journal, into p; false when it is not what that line must be.
bool fixed_field(std::size_t n, const std::vector<std::string>& w, engine::resume_point& p) {
  static const char* const names[] = {"window", "w_sparse", "target_iteration", "loss_scaler",
                                      "layout"};
  static const std::size_t sizes[] = {2, 2, 2, 5, 3};
  // The layout's EP degree is a fourth word (a journal of before it: 1).
  const bool layout_with_ep = n == 6 && w.size() == 4;
  if ((w.size() != sizes[n - 2] && !layout_with_ep) || w[0] != names[n - 2]) return false;
  const int max_workers = engine::max_job_workers;
  switch (n) {
    case 2:
      return parse_int(w[1], p.window);
    case 3:
      return parse_int(w[1], p.w_sparse) && p.w_sparse >= 1 && p.w_sparse <= (1 << 20);
    case 4:
      return parse_int(w[1], p.target_iteration) && p.target_iteration >= 0;
    case 5:
      p.scaler.enabled = w[1] == "1";
      return (w[1] == "0" || w[1] == "1") && parse_f32(w[2], p.scaler.scale) &&
             parse_int(w[3], p.scaler.good_steps) && parse_int(w[4], p.scaler.window);
    default:
      if (layout_with_ep && (!parse_int(w[3], p.ep) || p.ep < 1 || p.ep > max_workers)) {
        return false;
      }
      return parse_int(w[1], p.pp) && parse_int(w[2], p.dp) && p.pp >= 1 && p.pp <= max_workers &&
             p.dp >= 1 && p.dp <= max_workers && p.dp % p.ep == 0;
  }
}

}  // namespace

std::vector<std::pair<std::string, std::string>> state_identity(const engine::job_config& job) {
  const models::model_config& m = job.model;
  const models::train_config& t = job.train;
  auto f = [](auto v) { return fmt::format("{}", v); };
  std::vector<std::pair<std::string, std::string>> identity{
      {"model.preset", m.preset},
      {"model.layers", f(m.layers)},
      {"model.d_model", f(m.d_model)},
      {"model.heads", f(m.heads)},
      {"model.experts", f(m.experts)},
      {"model.top_k", f(m.top_k)},
      {"model.d_ff", f(m.d_ff)},
      {"model.max_seq_len", f(m.max_seq_len)},
      {"model.vocab", f(m.vocab)},
      {"model.shared_experts", f(m.shared_experts)},
      {"model.capacity_factor", f(m.capacity_factor)},
      {"model.aux_loss_coef", f(m.aux_loss_coef)},
      {"model.compute_dtype", std::string(models::dtype_name(m.compute_dtype))},
      {"train.micro_batches", f(t.micro_batches)},
      {"train.micro_batch_size", f(t.micro_batch_size)},
      {"train.seq_len", f(t.seq_len)},
      {"train.seed", f(t.seed)},
      {"train.lr", f(t.lr)},
      {"train.beta1", f(t.beta1)},
      {"train.beta2", f(t.beta2)},
      {"train.eps", f(t.eps)},
      {"train.weight_decay", f(t.weight_decay)},
      {"train.grad_clip", f(t.grad_clip)},
      {"train.corpus", t.corpus},
      {"train.val_fraction", f(t.val_fraction)},
      {"checkpoint.policy", engine::policy_name(job.policy)},
  };
  // Loss scaling runs only with f16 compute: elsewhere its keys change no bit.
  if (m.compute_dtype == models::dtype::f16) {
    identity.emplace_back("train.loss_scale", f(t.loss_scale));
    identity.emplace_back("train.loss_scale_window", f(t.loss_scale_window));
  }
  return identity;
}

std::filesystem::path resume_journal_dir(const std::filesystem::path& checkpoint_dir) {
  return checkpoint_dir / "head";
}

std::string resume_text(const engine::resume_point& p,
                        const std::vector<std::pair<std::string, std::string>>& identity) {
  std::string out = fmt::format(
      "moevement-resume {}\nwindow {}\nw_sparse {}\ntarget_iteration {}\n"
      "loss_scaler {} {} {} {}\nlayout {} {} {}\n",
      resume_journal::format_version, p.window, p.w_sparse, p.target_iteration,
      p.scaler.enabled ? 1 : 0, bits(p.scaler.scale), p.scaler.good_steps, p.scaler.window, p.pp,
      p.dp, p.ep);
  for (const auto& [id, first] : p.windows) {
    const auto size = p.window_sizes.find(id);
    out += fmt::format("durable {} {} {}\n", id, first,
                       size == p.window_sizes.end() ? p.w_sparse : size->second);
  }
  for (const auto& [it, s] : p.steps) {
    out += fmt::format("step {} {} {} {} {}\n", it, bits(s.loss_scale), s.plan.apply ? 1 : 0,
                       bits(s.plan.grad_mul), bits(s.plan.grad_norm));
  }
  return out + identity_lines(identity);
}

std::string identity_lines(const std::vector<std::pair<std::string, std::string>>& identity) {
  std::string out;
  for (const auto& [k, v] : identity) out += fmt::format("identity {} {}\n", k, v);
  return out;
}

std::optional<std::pair<std::string, std::string>> parse_identity_line(const std::string& line) {
  const std::string tag = "identity ";
  const auto space = line.find(' ', tag.size());
  if (line.compare(0, tag.size(), tag) != 0 || space == std::string::npos || space == tag.size() ||
      line.size() >= max_identity_value) {
    return std::nullopt;
  }
  return std::pair{line.substr(tag.size(), space - tag.size()), line.substr(space + 1)};
}

result<std::pair<engine::resume_point, std::vector<std::pair<std::string, std::string>>>>
parse_resume_text(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  std::size_t n = 0;
  auto bad = [&](const std::string& what) {
    return error{fmt::format("line {} of {}: {}", n, blob_name, what)};
  };
  engine::resume_point p;
  std::vector<std::pair<std::string, std::string>> identity;
  int stage_of_file = 0;  // 0: header, 1: fixed fields, 2: lists
  while (std::getline(in, line)) {
    if (++n > max_lines) return bad("too many lines");
    const auto w = words(line);
    if (n == 1) {
      int version = 0;
      if (w.size() != 2 || w[0] != "moevement-resume" || !parse_int(w[1], version)) {
        return bad("no moevement-resume header");
      }
      if (version != resume_journal::format_version) {
        return bad(fmt::format("format {} is not {} (written by another moevement version)",
                               version, resume_journal::format_version));
      }
      stage_of_file = 1;
      continue;
    }
    if (n <= 6) {  // the fixed fields, in order
      if (!fixed_field(n, w, p)) return bad("malformed");
      if (n == 6) stage_of_file = 2;
      continue;
    }
    if ((w.size() == 3 || w.size() == 4) && w[0] == "durable") {
      std::uint64_t id = 0;
      std::int64_t first = 0;
      int size = p.w_sparse;  // a journal of before W_sparse could change: one for all
      if (!parse_int(w[1], id) || !parse_int(w[2], first) || first < 0 ||
          (w.size() == 4 && (!parse_int(w[3], size) || size < 1 || size > (1 << 20))) ||
          !p.windows.emplace(id, first).second) {
        return bad("malformed durable window");
      }
      p.window_sizes[id] = size;
    } else if (w.size() == 6 && w[0] == "step") {
      std::int64_t it = 0;
      engine::planned_step s;
      if (!parse_int(w[1], it) || !parse_f32(w[2], s.loss_scale) || (w[3] != "0" && w[3] != "1") ||
          !parse_f32(w[4], s.plan.grad_mul) || !parse_f64(w[5], s.plan.grad_norm) || it < 0 ||
          it >= p.target_iteration) {
        return bad("malformed step");
      }
      s.plan.apply = w[3] == "1";
      if (!p.steps.emplace(it, s).second) return bad("a step twice");
    } else if (auto kv = parse_identity_line(line)) {
      identity.push_back(std::move(*kv));
    } else {
      return bad("unexpected");
    }
  }
  if (stage_of_file != 2) return error{fmt::format("{} is truncated", blob_name)};
  // The windows' replays need every step from the oldest one's first iteration.
  if (!p.windows.contains(p.window)) return error{"the journal's window is not among its windows"};
  const std::int64_t from = p.windows.begin()->second;
  if (from > p.target_iteration) return error{"a window starts after the target iteration"};
  for (std::int64_t it = from; it < p.target_iteration; ++it) {
    if (!p.steps.contains(it)) return error{fmt::format("the step of iteration {} is missing", it)};
  }
  return std::pair{std::move(p), std::move(identity)};
}

resume_journal::resume_journal(const engine::job_config& job)
    : dir_(resume_journal_dir(job.baseline.dir)),
      identity_(state_identity(job)),
      keep_(std::size_t(job.baseline.keep) + 2) {}

void resume_journal::write(const engine::resume_point& point) const {
  const std::string text = resume_text(point, identity_);
  durable_store store(dir_);
  if (point.drop_newer) store.drop_after(point.window);
  const blob_view blob{blob_name, std::as_bytes(std::span(text.data(), text.size()))};
  store.write_window(point.window, std::span(&blob, 1));
  store.prune(keep_);
}

bool resume_journal::empty() const {
  // A journal directory that exists but cannot be listed (or is no directory) is no empty one:
  // durable_store throws, naming it, rather than a requeued job starting over.
  std::error_code ec;
  if (!std::filesystem::exists(dir_, ec) && !ec) return true;
  return durable_store(dir_).windows().empty();
}

result<engine::resume_point> resume_journal::load(std::vector<std::string>* rejected,
                                                  std::optional<std::uint64_t> before) const {
  if (!std::filesystem::is_directory(dir_)) {
    // (No job journaled here, or the one that ran was killed before its first durable window
    // reached the disk: the journal's directory is made with that window's entry.)
    return error{fmt::format(
        "nothing to resume: {} {} (a job writes it when its first durable window is on disk, "
        "running with checkpoint.policy = \"moevement\" and checkpoint.durable = true under "
        "the same checkpoint.dir: a job killed before that has nothing to go on from; run it "
        "anew)",
        dir_.string(), std::filesystem::exists(dir_) ? "is not a directory" : "does not exist")};
  }
  const durable_store store(dir_);
  const auto listed = store.listed_windows();
  if (!listed.ok()) return listed.err();
  const auto& ids = *listed;
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    if (before && *it >= *before) continue;
    auto loaded = store.load(*it);
    std::string why;
    if (!loaded.ok()) {
      why = loaded.err().message;
    } else if (auto b = loaded->blobs.find(blob_name); b == loaded->blobs.end()) {
      why = fmt::format("it has no {}", blob_name);
    } else {
      auto parsed = parse_resume_text(
          std::string(reinterpret_cast<const char*>(b->second.data()), b->second.size()));
      if (!parsed.ok()) {
        why = parsed.err().message;
      } else if (parsed->first.window != *it) {
        why = fmt::format("it says window {}", parsed->first.window);
      } else {
        // Written by this job's training, or refused naming what differs.
        if (auto d = identity_difference(identity_, parsed->second)) {
          return error{fmt::format(
              "the checkpoint in {} was written by a job with {}: resume with the settings it "
              "was written with",
              dir_.parent_path().string(), *d)};
        }
        return std::move(parsed->first);
      }
    }
    if (rejected != nullptr) rejected->push_back(fmt::format("journal {}: {}", *it, why));
  }
  return error{fmt::format("nothing to resume in {}: {} journal(s), none usable{}", dir_.string(),
                           ids.size(), ids.empty() ? "" : " (see the reasons above)")};
}

std::optional<std::string> identity_difference(
    const std::vector<std::pair<std::string, std::string>>& mine,
    const std::vector<std::pair<std::string, std::string>>& theirs) {
  for (const auto& [key, value] : mine) {
    const auto at =
        std::find_if(theirs.begin(), theirs.end(), [&](const auto& kv) { return kv.first == key; });
    const std::string was = at == theirs.end() ? "(not recorded)" : at->second;
    if (was != value) return fmt::format("{} = {}; this config has {}", key, was, value);
  }
  return std::nullopt;
}

void resume_journal::drop_after(std::uint64_t window) const {
  if (std::filesystem::is_directory(dir_)) durable_store(dir_).drop_after(window);
}

void resume_journal::clear() const {
  if (std::filesystem::is_directory(dir_)) durable_store(dir_).clear();
}

}  // namespace moevement::recovery
