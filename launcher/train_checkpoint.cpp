#include "launcher/train_checkpoint.hpp"

#include <fmt/format.h>

#include <sstream>
#include <stdexcept>

#include "base/result.hpp"
#include "recovery/resume_journal.hpp"
#include "recovery/snapshot.hpp"

namespace moevement::launcher {

namespace {

constexpr const char* state_blob = "state";
constexpr const char* identity_blob = "train.txt";
constexpr const char* identity_header = "moevement-train-checkpoint 1";

using identity = std::vector<std::pair<std::string, std::string>>;

std::string identity_text(const identity& id) {
  return fmt::format("{}\n", identity_header) + recovery::identity_lines(id);
}

// Strict: a file from disk is untrusted.
result<identity> parse_identity(const std::vector<std::byte>& bytes) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  std::string line;
  if (!std::getline(in, line) || line != identity_header) {
    return error{fmt::format("{} does not start with '{}'", identity_blob, identity_header)};
  }
  identity out;
  while (std::getline(in, line)) {
    auto kv = recovery::parse_identity_line(line);
    if (!kv)
      return error{fmt::format("{}: unexpected line '{}'", identity_blob, line.substr(0, 80))};
    out.push_back(std::move(*kv));
  }
  return out;
}

std::vector<const models::operator_state*> operators_of(models::trainer& tr) {
  std::vector<const models::operator_state*> ops;
  for (const auto& o : tr.model().ops()) ops.push_back(&o);
  return ops;
}

}  // namespace

train_checkpoints::train_checkpoints(std::filesystem::path dir, const engine::job_config& job)
    : store_(std::move(dir)), identity_(recovery::state_identity(job)) {}

void train_checkpoints::write(models::trainer& tr) {
  const auto ops = operators_of(tr);
  const std::vector<recovery::capture_kind> kinds(ops.size(), recovery::capture_kind::full);
  std::vector<std::byte> state(recovery::snapshot_size(ops, kinds));
  recovery::snapshot_tag tag;
  tag.state_iteration = tr.iteration();
  recovery::write_snapshot(state, tag, tr.scaler(), ops, kinds);
  const std::string text = identity_text(identity_);
  const recovery::blob_view blobs[] = {
      {state_blob, state}, {identity_blob, std::as_bytes(std::span(text.data(), text.size()))}};
  store_.write_window(std::uint64_t(tr.iteration()), blobs);
  store_.prune(train_checkpoints_kept);
}

std::int64_t train_checkpoints::resume(models::trainer& tr,
                                       std::vector<std::string>* rejected) const {
  const auto ids = store_.windows();
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    std::string why;
    auto loaded = store_.load(*it);
    if (!loaded.ok()) {
      why = loaded.err().message;
    } else if (!loaded->blobs.contains(state_blob) || !loaded->blobs.contains(identity_blob)) {
      why = fmt::format("it lacks the {} or the {} blob", state_blob, identity_blob);
    } else if (auto theirs = parse_identity(loaded->blobs.at(identity_blob)); !theirs.ok()) {
      why = theirs.err().message;
    } else {
      if (auto d = recovery::identity_difference(identity_, *theirs)) {
        throw std::runtime_error(fmt::format(
            "the checkpoint in {} was written by a job with {}: resume with the settings it "
            "was written with",
            store_.dir().string(), *d));
      }
      try {
        const auto view = recovery::parse_snapshot(loaded->blobs.at(state_blob));
        auto& ops = tr.model().ops();
        if (view.entries.size() != ops.size() || view.tag.state_iteration != std::int64_t(*it)) {
          throw recovery::snapshot_error(
              fmt::format("it holds {} operators at iteration {}; this model has {}",
                          view.entries.size(), view.tag.state_iteration, ops.size()));
        }
        for (std::size_t i = 0; i < ops.size(); ++i) {
          recovery::load_operator(view.entries[i], ops[i]);
        }
        tr.set_position(view.tag.state_iteration, view.scaler);
        return view.tag.state_iteration;
      } catch (const recovery::snapshot_error& e) {
        why = e.what();
      }
    }
    if (rejected != nullptr) rejected->push_back(fmt::format("checkpoint {}: {}", *it, why));
  }
  throw std::runtime_error(fmt::format("nothing to resume in {}: {} checkpoint(s), none usable{}",
                                       store_.dir().string(), ids.size(),
                                       ids.empty() ? "" : " (reasons above)"));
}

}  // namespace moevement::launcher
