// A recovery group's replay spread over its members (docs/recovery.md "The group replays in
// parallel"). Every replica of a lost stage's data-parallel group, survivors rolled back
// too, replays its own replica on its own worker; after each replayed iteration the members
// sum their weight gradients as training does, g_0 + g_1 + ... in replica order, so each
// ends with the bits a replay of the whole group in one process gives.
//
// How the gradients move: a member copies its gradients into an exported buffer and tells
// every other member's group_exchange where they are (ReplayGradients); each member pulls
// the others' one after the other and folds them in replica order. Two buffers and no
// acknowledgements: a member rewrites the buffer of iteration i at i + 2, after it has every
// peer's announcement of i + 1, which each peer sends only once it pulled this member's of i.
// At the end each member says it is done and waits for everyone's word before it lets its
// buffers go.
//
// Under expert parallelism a member's buffer holds its non-expert gradients and each source's
// part of its block of experts (group_layout); the non-experts sum over every member, each
// block over its copies' sources (fold_group). The members' replay routers, which compute the
// EP groups' rows meanwhile, are named to each other through the same exchanges
// (ReplayExperts, kept in the gradients' inbox).
#pragma once

#include <asio/awaitable.hpp>
#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "actors/system.hpp"
#include "engine/bulk_io.hpp"
#include "engine/engine.capnp.h"
#include "recovery/recovery.capnp.h"
#include "recovery/sparse_to_dense.hpp"
#include "transport/bulk.hpp"

namespace moevement::recovery {

// What this worker's group_exchange received, for the replay in progress here. Actor thread
// only. Bounded: announcements of an older generation than the newest restore begun here
// are refused, and at most `max_entries` are kept.
class group_inbox {
 public:
  explicit group_inbox(asio::io_context& io, std::size_t max_entries = 4096)
      : io_(io), max_entries_(max_entries) {}

  // A restore of `generation` begins here: waits of older generations end with an error
  // (superseded) and their announcements are dropped.
  void begin(std::uint64_t generation);
  // A peer's announcement; false when refused (an older generation, or the inbox is full).
  // One of a newer generation than begun here is kept for it (only begin() moves on: the
  // coordinator's ReplayGeneration, or this worker's Restore).
  bool put(std::uint64_t generation, std::int64_t iteration, std::uint32_t replica,
           const transport::bulk_descriptor& d);
  // Waits until `replica` announced `iteration` of `generation` and takes its descriptor.
  // Throws std::runtime_error when superseded, after `timeout`, or at once when `replica`
  // announced `ended` instead (the marker of a replay that is over: the members disagree on
  // what to replay, and the wait would last its whole timeout). `what`: what a long wait's
  // report says never came (by default, a group member's gradients).
  asio::awaitable<transport::bulk_descriptor> take(std::uint64_t generation, std::int64_t iteration,
                                                   std::uint32_t replica,
                                                   std::chrono::steady_clock::duration timeout,
                                                   std::optional<std::int64_t> ended = std::nullopt,
                                                   std::string_view what = {});
  std::size_t size() const { return got_.size() + routers_.size(); }
  // The newest generation begun here.
  std::uint64_t generation() const { return generation_; }
  // Announcements refused (an older generation, or the inbox full), for the reports of a
  // long wait.
  std::uint64_t refused() const { return refused_; }
  // What the inbox holds, for the report of a wait that goes on long: its generation and the
  // first announcements kept.
  std::string describe() const;
  // Whose replay waits here ("stage 1 replica 0"), named in its reports of a long wait.
  void set_label(std::string label) { label_ = std::move(label); }
  const std::string& label() const { return label_; }

  // Under expert parallelism: a peer's replay router (ReplayExperts), kept and taken as an
  // announcement is.
  bool put_router(std::uint64_t generation, std::uint32_t replica, actors::actor_ref router);
  asio::awaitable<actors::actor_ref> take_router(std::uint64_t generation, std::uint32_t replica,
                                                 std::chrono::steady_clock::duration timeout);
  // `stop` runs once a newer generation than `generation` begins here (at once if one has):
  // what waits outside the inbox (a replay's expert router) ends with the replay.
  void when_superseded(std::uint64_t generation, std::function<void()> stop);

 private:
  void wake_all();
  // Waits (as take does) until `ready` gives a value; `what` says what never came.
  template <class T, class Ready>
  asio::awaitable<T> wait_for(std::uint64_t generation, std::chrono::steady_clock::duration timeout,
                              Ready ready, const std::string& what);

  asio::io_context& io_;
  std::size_t max_entries_;
  std::uint64_t generation_ = 0;  // the newest restore begun here
  std::uint64_t refused_ = 0;
  std::map<std::tuple<std::uint64_t, std::int64_t, std::uint32_t>, transport::bulk_descriptor> got_;
  std::map<std::pair<std::uint64_t, std::uint32_t>, actors::actor_ref> routers_;
  std::multimap<std::uint64_t, std::function<void()>> on_superseded_;
  std::set<asio::steady_timer*> waiters_;  // cancelled (woken) on every put and begin
  std::string label_;
};

// One per worker (policy moevement): peers' ReplayGradients into the gradients' inbox, and
// a pipelined region's neighbours' ReplayBoundary into the boundaries' (keyed by iteration and
// boundary_exchange::tag).
class group_exchange : public actors::actor {
 public:
  using interface =
      actors::interface<actors::tell_t<wire::ReplayGradients>, actors::tell_t<wire::ReplayBoundary>,
                        actors::tell_t<engine::wire::ReplayGeneration>,
                        actors::tell_t<wire::ReplayExperts>>;
  group_exchange(std::shared_ptr<group_inbox> gradients, std::shared_ptr<group_inbox> boundaries);
  std::uint64_t refused() const { return refused_; }

 private:
  asio::awaitable<void> gradients(wire::ReplayGradients::Reader m);
  asio::awaitable<void> boundary(wire::ReplayBoundary::Reader m);
  asio::awaitable<void> experts(wire::ReplayExperts::Reader m);
  // A new generation of the replay begins (the worker's agent may be busy with the old one,
  // whose waits end now).
  asio::awaitable<void> generation(engine::wire::ReplayGeneration::Reader m);
  std::shared_ptr<group_inbox> inbox_, boundaries_;
  std::uint64_t refused_ = 0;
};

// One member's side of one generation's replay. Made and dropped on the actor thread;
// reduce() runs on the replay's thread.
class group_reducer {
 public:
  // peers[d]: the group exchange of the member replaying replica d (this member's own entry
  // is not used). layout: the region's gradients, every stage's, stage order
  // (recovery/sparse_to_dense.hpp).
  group_reducer(actors::actor_system& system, engine::bulk_io& io,
                std::shared_ptr<group_inbox> inbox, std::uint64_t generation, std::uint32_t replica,
                std::vector<actors::actor_ref> peers, group_layout layout,
                std::uint64_t pull_chunk_bytes, std::chrono::steady_clock::duration wait);

  // On the replay's thread (never the actor thread): `grads` (this member's, layout.floats())
  // becomes the sum over the group in replica order, in its first layout.dense + layout.block
  // floats (fold_group). Throws when a peer's announcement does not come (superseded by a
  // newer generation, or the wait ran out), or does not match.
  void reduce(std::int64_t iteration, std::span<float> grads);
  // On the actor thread, once the replay is over: tells the peers this member pulled all it
  // needed and waits until each says the same, so that no buffer goes while a peer still
  // pulls it. Throws as reduce() does.
  asio::awaitable<void> finish();

 private:
  static constexpr std::int64_t done_ = INT64_MAX;  // the iteration of finish()'s message
  // On the actor thread: announce this member's buffer, take peer d's descriptor and pull it.
  asio::awaitable<void> announce(std::int64_t iteration, const transport::bulk_descriptor& mine);
  asio::awaitable<void> pull(std::int64_t iteration, std::uint32_t d);
  // Runs `task` on the actor thread and waits for it (from the replay's thread).
  template <class Task>
  void on_actor_thread(Task task, std::function<std::string()> what);

  actors::actor_system& system_;
  engine::bulk_io& io_;
  std::shared_ptr<group_inbox> inbox_;
  std::uint64_t generation_;
  std::uint32_t replica_;
  std::vector<actors::actor_ref> peers_;
  group_layout layout_;
  std::size_t floats_;
  std::uint64_t chunk_;
  std::chrono::steady_clock::duration wait_;
  transport::bulk_region buffers_[2];
  std::shared_ptr<std::vector<float>> incoming_;  // made by the first reduce()
  std::atomic<bool> pulling_{false};  // set on the actor thread, read by a long wait's report
};

// One member's side of a joint region replayed as a pipeline (docs/recovery.md "The group
// replays in parallel"): this member replays one stage of the region; the members replaying
// the stage before and after it (the same replica) send it their activations and gradients,
// and it sends them its own, per micro-batch, the moment each is made. A tensor is copied into
// an exported buffer (a slot per micro-batch and direction), announced to the neighbour's
// group exchange (ReplayBoundary) and pulled there. One buffer per direction is enough: this
// stage rewrites its activation of micro-batch mb in iteration i + 1 only after the stage
// after sent it every gradient of i, which that stage did only after pulling every activation
// of i (and the same the other way round). Made and dropped on the actor thread; take() and
// send() run on the replay's thread.
class boundary_exchange {
 public:
  // The inbox key of a tensor: its micro-batch and direction.
  static std::uint32_t tag(int mb, bool gradient) { return std::uint32_t(mb) * 2 + gradient; }

  // before / after: the group exchange of the member replaying the stage before / after this
  // one (invalid: that side is outside the region; its tensors come from a log, and none are
  // sent to it). floats: of one boundary tensor.
  boundary_exchange(actors::actor_system& system, engine::bulk_io& io,
                    std::shared_ptr<group_inbox> inbox, std::uint64_t generation,
                    actors::actor_ref before, actors::actor_ref after, std::size_t floats,
                    int micro_batches, std::uint64_t pull_chunk_bytes,
                    std::chrono::steady_clock::duration wait);

  // The activation of (iteration, mb) from the stage before, or the gradient from the stage
  // after. Throws when it does not come (superseded by a newer generation, or the wait ran
  // out) or does not match.
  std::vector<float> take(std::int64_t iteration, int mb, bool gradient);
  // What take() runs while it waits (every millisecond): under expert parallelism the replay
  // serves its EP group's rows meanwhile, or a peer waiting for them could wait on this one.
  void set_idle(std::function<void()> idle) { idle_ = std::move(idle); }
  // This stage's activation (to the stage after) or input gradient (to the stage before).
  void send(std::int64_t iteration, int mb, bool gradient, std::span<const float> t);
  // On the actor thread, once the replay is over: tells the neighbours this member pulled all
  // it needed and waits until each says the same, so that no buffer goes while one still
  // pulls it. Throws as take() does.
  asio::awaitable<void> finish();

 private:
  static constexpr std::int64_t done_ = INT64_MAX;  // the iteration of finish()'s message
  asio::awaitable<void> announce(std::int64_t iteration, int mb, bool gradient,
                                 transport::bulk_descriptor d);
  asio::awaitable<void> pull(std::int64_t iteration, int mb, bool gradient);

  actors::actor_system& system_;
  engine::bulk_io& io_;
  std::shared_ptr<group_inbox> inbox_;
  std::uint64_t generation_;
  actors::actor_ref before_, after_;
  std::size_t floats_;
  int micro_batches_;
  std::uint64_t chunk_;
  std::chrono::steady_clock::duration wait_;
  transport::bulk_region activations_, gradients_;  // [mb] slots of floats_, sent from here
  std::shared_ptr<std::vector<float>> incoming_;
  std::function<void()> idle_;
};

}  // namespace moevement::recovery
