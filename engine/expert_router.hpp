// Expert parallelism across processes (parallel.ep > 1): the rows a stage's gate routes to
// experts that other replicas of its EP group hold go there, and their outputs come back
// (models/expert_exchange.hpp says why that changes no bit).
//
// Two halves share one expert_router:
// - the stage's compute thread calls it as its model's models::expert_exchange: it sends each
//   owner its rows and waits for the answers. While it waits it serves the rows other replicas
//   sent to this replica's experts: they wait on it the same way, so every wait serves and the
//   EP group's replicas, which run the same 1F1B schedule, never wait on each other in a cycle;
// - the expert_router_actor takes the ExpertRows and ExpertOutput messages, pulls their tensors
//   and hands them over. It is an actor of its own because the stage actor's mailbox is not
//   read while the stage computes.
// Rows that arrive while the compute thread is elsewhere are served by a task the stage actor
// runs there (set_wake).
//
// A source waits for every answer before it sends again, so each peer needs one buffer in each
// direction: the rows it sent last, and the answer to them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "actors/system.hpp"
#include "engine/bulk_io.hpp"
#include "engine/compute_watch.hpp"
#include "engine/engine.capnp.h"
#include "engine/stage_model.hpp"

namespace moevement::engine {

// A waiting exchange that was stopped (a peer lost, the stage going away).
class exchange_stopped : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One message's rows (ExpertRows), decoded.
struct expert_request {
  int source = 0, layer = 0, mb = 0;
  bool backward = false;
  std::uint64_t epoch = 0, seq = 0;
  std::vector<int> rows;  // forward: per expert of the receiver's block
  std::size_t floats = 0;
};
// What a router takes: its EP rank of ep, experts per layer, floats per row (C), at most
// max_floats floats per message, the stage's layers [first_layer, last_layer) and its
// micro-batches.
struct expert_router_shape {
  int rank = 0, ep = 1, experts = 1, c = 1;
  std::size_t max_floats = 0;
  int first_layer = 0, last_layer = 0, micro_batches = 1;
};
// Whether a peer's request with a tensor of `bytes` is one this router can take: a source of
// its group other than itself, a layer of this stage, a micro-batch of the iteration (or -1,
// validation), a forward's row counts for each expert of its block summing to the tensor, a
// backward with none, within the buffers.
bool expert_rows_fit(const expert_request& r, std::size_t bytes, const expert_router_shape& s);

class expert_router final : public models::expert_exchange,
                            public std::enable_shared_from_this<expert_router> {
 public:
  // The router of (setup.stage, setup.replica): EP rank replica % ep of its group.
  expert_router(actors::actor_system& system, bulk_io& io, const stage_setup& setup);

  int rank() const { return rank_; }
  int ep() const { return ep_; }

  // ---- set-up, on the actor thread
  void attach(models::expert_shard* shard);
  // How serve_pending() gets run on the stage's compute thread when rows arrive.
  void set_wake(std::function<void()> wake) { wake_ = std::move(wake); }
  // Where the compute thread's waits for its peers' rows are marked (the stuck-stage probe).
  void set_watch(std::shared_ptr<compute_watch> watch) { watch_ = std::move(watch); }
  // Called (on the compute thread) once every source's backwards of the epoch were computed
  // here: the expert block's gradient is complete, its fold may start.
  void set_on_complete(std::function<void()> f) { on_complete_ = std::move(f); }
  // Whether every source's backwards of the current epoch (micro_batches x the stage's
  // layers each) were computed here.
  bool complete() const;
  void set_actor(actors::actor_ref self) { self_ = self; }
  actors::actor_ref actor() const { return self_; }
  // The routers of the EP group, by rank (after each wiring).
  void set_peers(std::vector<actors::actor_ref> peers) { peers_ = std::move(peers); }
  const std::vector<actors::actor_ref>& peers() const { return peers_; }

  // ---- the stage's compute thread
  // After the model's begin_iteration: rows of this epoch are served from now on.
  void begin_epoch(std::uint64_t epoch);
  // Serves every request that can be.
  void serve_pending();
  // Waits, serving, until complete() (a replay's end of an iteration: every source's
  // backwards computed here). Throws exchange_stopped when stopped meanwhile.
  void drain();
  // models::expert_exchange. Throws exchange_stopped when stopped while waiting.
  void forward(int layer, int mb, std::span<const int> offsets, std::span<const float> xs,
               std::span<float> ye, bool training) override;
  void backward(int layer, int mb, std::span<const int> offsets, std::span<const float> d_ye,
                std::span<float> d_xs) override;

  // Seconds the compute thread waited for answers since the last call (compute thread).
  double take_wait_s() { return std::exchange(wait_s_, 0.0); }
  // Peers' messages refused as malformed (or not awaited) so far (any thread).
  std::uint64_t refused() const { return refused_.load(); }
  void count_refused() { ++refused_; }

  // ---- any thread
  // A waiting exchange throws exchange_stopped(why), now and until resume().
  void stop(const std::string& why);
  // After an aborted iteration: waits allowed again. Its peers' requests are still served
  // (they may be computing it until their own Abort); the next epoch drops them.
  void resume();

  // ---- the router actor (actor thread): a peer's message, checked; false: malformed
  using request = expert_request;
  bool check_rows(const request& r, std::size_t bytes) const {
    return expert_rows_fit(r, bytes, shape_);
  }
  std::span<float> rows_buffer(int source);  // where a request's tensor is pulled
  void rows_arrived(request r);
  // An owner's answer, decoded.
  struct answer {
    int owner = 0, layer = 0, mb = 0;
    bool backward = false;
    std::uint64_t epoch = 0, seq = 0;
    std::size_t bytes = 0;
  };
  // Where the answer's tensor goes, if this very answer is awaited (nullopt: refused).
  std::optional<std::span<float>> output_buffer(const answer& a);
  // It is here (checked again: a wait given up meanwhile takes nothing).
  void output_arrived(const answer& a);
  // The owner could not compute the rows: the waiting exchange throws with its reason.
  void output_failed(const answer& a, const std::string& why);

 private:
  struct awaited {
    bool waiting = false, arrived = false;
    int layer = 0, mb = 0;
    bool backward = false;
    std::uint64_t epoch = 0, seq = 0;
    std::size_t floats = 0;
    std::string error;  // the owner's, when it could not compute them
    bool matches(const answer& a) const {
      return waiting && !arrived && a.layer == layer && a.mb == mb && a.backward == backward &&
             a.epoch == epoch && a.seq == seq;
    }
  };
  void exchange(int layer, int mb, bool backward, bool training, std::span<const int> offsets,
                std::span<const float> in, std::span<float> out);
  void serve(const request& r);
  // Requests that can be served now (this epoch's, or validation's); drops older epochs'.
  std::vector<request> take_servable();  // mu_ held
  bool complete_held() const;            // complete(), mu_ held
  void send_rows(int owner, const request& r);
  void send_output(const request& r, const std::string& error);
  std::span<float> slot(const transport::bulk_region& region, int k) const;

  actors::actor_system& system_;
  const int rank_, ep_, experts_, c_;
  const std::size_t max_floats_;  // one message's tensor: at most N*K rows of C
  expert_router_shape shape_;     // the above and the stage's layers (attach())
  std::uint64_t seq_ = 0;         // this replica's exchanges (compute thread)
  models::expert_shard* shard_ = nullptr;
  std::function<void()> wake_, on_complete_;
  // the backward one source's rows took here (this epoch), once its rows were computed
  void backward_done(int source);
  actors::actor_ref self_;
  std::vector<actors::actor_ref> peers_;
  // outgoing, exported: [ep][max_floats] rows sent to each owner, answers to each source
  transport::bulk_region rows_out_, answers_out_;
  std::vector<std::vector<float>> rows_in_, answers_in_;  // [ep][max_floats] pull targets
  std::shared_ptr<compute_watch> watch_;
  double wait_s_ = 0.0;  // the compute thread's
  std::atomic<std::uint64_t> refused_{0};

  mutable std::mutex mu_;  // what follows: shared by the compute thread and the actor thread
  std::condition_variable cv_;
  std::deque<request> requests_;
  std::vector<awaited> awaited_;  // [ep] by owner
  std::uint64_t epoch_ = 0;
  std::vector<int> backwards_;  // [ep] this epoch's backwards computed here, by source
  int expected_backwards_;      // per source and epoch: micro-batches x layers
  bool stopped_ = false;
  std::string why_;
};

// The message half (see above). Malformed messages are counted and dropped.
class expert_router_actor : public actors::actor {
 public:
  using interface =
      actors::interface<actors::tell_t<wire::ExpertRows>, actors::tell_t<wire::ExpertOutput>>;
  expert_router_actor(std::shared_ptr<expert_router> router, bulk_io& io);
  std::uint64_t dropped() const { return router_->refused(); }

 protected:
  asio::awaitable<void> on_down(actors::actor_ref who, actors::exit_reason why) override;

 private:
  asio::awaitable<void> rows(wire::ExpertRows::Reader m);
  asio::awaitable<void> output(wire::ExpertOutput::Reader m);

  std::shared_ptr<expert_router> router_;
  bulk_io& io_;
};

}  // namespace moevement::engine
