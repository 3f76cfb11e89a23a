#include "recovery/durable_window.hpp"

#include <fmt/format.h>

#include <charconv>
#include <sstream>

#include "base/parse.hpp"
#include "recovery/snapshot.hpp"

namespace moevement::recovery {
namespace {

constexpr const char* meta_name = "window.meta";
// More slots than this is not a window we wrote (W_sparse is at most 2^20 by config, far
// less in practice; the bound keeps a damaged meta from asking for a huge allocation).
constexpr std::int64_t max_slots = 1 << 20;

std::string slot_name(std::size_t j) {
  return fmt::format("slot-{:06}.snap", j);
}

std::string meta_text(const durable_window_meta& m) {
  return fmt::format(
      "moevement-window {}\nstage {}\nreplica {}\nwindow {}\nfirst_iteration {}\nw_sparse {}\n",
      durable_window_format, m.stage, m.replica, m.window, m.first_iteration, m.w_sparse);
}

result<durable_window_meta> parse_meta(const std::vector<std::byte>& bytes) {
  const std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  std::istringstream in(text);
  std::string line;
  auto field = [&](const char* name, auto& out) -> bool {
    if (!std::getline(in, line)) return false;
    const std::string prefix = std::string(name) + " ";
    return line.rfind(prefix, 0) == 0 && parse_int(line.substr(prefix.size()), out);
  };
  int version = 0;
  durable_window_meta m;
  if (!field("moevement-window", version)) return error{"window.meta has no moevement header"};
  if (version != durable_window_format) {
    return error{fmt::format("window.meta format {} is not {} (written by another version)",
                             version, durable_window_format)};
  }
  if (!field("stage", m.stage) || !field("replica", m.replica) || !field("window", m.window) ||
      !field("first_iteration", m.first_iteration) || !field("w_sparse", m.w_sparse) ||
      std::getline(in, line)) {
    return error{"window.meta is malformed"};
  }
  if (m.w_sparse < 1 || m.w_sparse > max_slots || m.first_iteration < 0) {
    return error{"window.meta has values out of range"};
  }
  return m;
}

}  // namespace

std::filesystem::path durable_window_dir(const std::filesystem::path& root, int stage,
                                         int replica) {
  return root / fmt::format("stage-{}-replica-{}", stage, replica);
}

std::uint64_t write_durable_window(durable_store& store, const durable_window_meta& meta,
                                   std::span<const std::span<const std::byte>> slots) {
  if (slots.size() != std::size_t(meta.w_sparse)) {
    throw std::invalid_argument(fmt::format("durable window {}: {} slots for W_sparse {}",
                                            meta.window, slots.size(), meta.w_sparse));
  }
  const std::string text = meta_text(meta);
  std::vector<std::string> names;
  std::vector<blob_view> blobs;
  std::uint64_t bytes = text.size();
  for (std::size_t j = 0; j < slots.size(); ++j) names.push_back(slot_name(j));
  for (std::size_t j = 0; j < slots.size(); ++j) {
    blobs.push_back({names[j], slots[j]});
    bytes += slots[j].size();
  }
  blobs.push_back({meta_name, std::as_bytes(std::span(text.data(), text.size()))});
  store.write_window(meta.window, blobs);
  return bytes;
}

result<durable_window> load_durable_window(const durable_store& store, std::uint64_t id, int stage,
                                           int replica) {
  auto w = store.load(id);
  if (!w.ok()) return error{w.err().message};
  auto bad = [&](const std::string& what) -> error {
    return error{fmt::format("window {}: {}", id, what)};
  };
  const auto meta_it = w->blobs.find(meta_name);
  if (meta_it == w->blobs.end()) return bad("no window.meta (not a moevement window)");
  auto meta = parse_meta(meta_it->second);
  if (!meta.ok()) return bad(meta.err().message);
  if (meta->window != id || meta->stage != stage || meta->replica != replica) {
    return bad(fmt::format("window.meta names stage {} replica {} window {}", meta->stage,
                           meta->replica, meta->window));
  }
  if (w->blobs.size() != std::size_t(meta->w_sparse) + 1) {
    return bad(fmt::format("{} files for {} slots", w->blobs.size(), meta->w_sparse));
  }
  durable_window out;
  out.meta = *meta;
  for (int j = 0; j < meta->w_sparse; ++j) {
    const auto it = w->blobs.find(slot_name(std::size_t(j)));
    if (it == w->blobs.end()) return bad(fmt::format("slot {} is missing", j));
    try {
      const auto view = parse_snapshot(it->second);
      if (view.tag.window != id || view.tag.slot != std::uint32_t(j) || view.tag.stage != stage ||
          view.tag.replica != replica) {
        return bad(fmt::format("slot {} is tagged window {} slot {} of stage {} replica {}", j,
                               view.tag.window, view.tag.slot, view.tag.stage, view.tag.replica));
      }
    } catch (const snapshot_error& e) {
      return bad(fmt::format("slot {}: {}", j, e.what()));
    }
    out.slots.push_back(std::move(it->second));
  }
  return out;
}

std::vector<std::uint64_t> verified_durable_windows(const durable_store& store, int stage,
                                                    int replica,
                                                    std::vector<std::string>* rejected) {
  std::vector<std::uint64_t> ok;
  const auto ids = store.listed_windows();
  if (!ids.ok()) {  // unlistable: none verified, and said why
    if (rejected != nullptr) rejected->push_back(ids.err().message);
    return ok;
  }
  for (const std::uint64_t id : *ids) {
    auto w = load_durable_window(store, id, stage, replica);
    if (w.ok()) {
      ok.push_back(id);
    } else if (rejected != nullptr) {
      rejected->push_back(w.err().message);
    }
  }
  return ok;
}

durable_writer::durable_writer() : thread_([this] { loop(); }) {}

durable_writer::~durable_writer() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void durable_writer::post(std::function<void()> job) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_all();
}

void durable_writer::drain() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

void durable_writer::loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    auto job = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    job();  // jobs catch their own errors (they report them)
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

}  // namespace moevement::recovery
