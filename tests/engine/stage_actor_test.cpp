// The stage actor's side of a recovery's abort, in one process over a real actor system: a
// stage that failed on an input of an epoch it had not begun (an activation that came before
// its Iterate, pulled from a peer that died meanwhile) drops that epoch's Iterate; the
// recovery's Abort of that epoch must clear the failure all the same, or the stage drops every
// later Iterate too and the job waits for it for ever (no timeout covers an iteration).
#include "engine/stage_actor.hpp"

#include <gtest/gtest.h>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "transport/loopback_link.hpp"
#include "transport/ucx_link.hpp"

namespace moevement::engine {
namespace {

using namespace std::chrono_literals;
using actors::awaitable;

// Stands in for the coordinator: records the failures the stage reports.
class failure_recorder : public actors::actor {
 public:
  using interface = actors::interface<actors::tell_t<wire::StageFailed>>;
  explicit failure_recorder(std::vector<std::string>& failures) : failures_(failures) {
    on<wire::StageFailed>(&failure_recorder::failed);
  }

 private:
  awaitable<void> failed(wire::StageFailed::Reader m) {
    failures_.emplace_back(m.getMessage().cStr());
    co_return;
  }
  std::vector<std::string>& failures_;
};

stage_setup last_of_two() {
  stage_setup s;
  s.model = models::preset("tiny");
  s.train.micro_batches = 2;
  s.train.micro_batch_size = 2;
  s.train.seq_len = 8;
  s.stage = 1;
  s.stages = 2;
  return s;
}

TEST(stage_actor, an_abort_of_an_epoch_the_stage_never_began_clears_its_failure) {
  asio::io_context io;
  transport::loopback_hub hub(io);
  auto link = hub.attach(0);
  actors::actor_system sys(io, *link);
  // The stage's pulls go through a link of their own (to node 9, which it does not know).
  transport::ucx_link_options o;
  o.self = 0;
  o.job_token = "stage-actor-test";
  transport::ucx_link bulk_link(io, o);
  bulk_io bulk(bulk_link);

  std::vector<std::string> failures;
  auto coord = sys.spawn<failure_recorder>(failures);
  const auto setup = last_of_two();
  auto model = make_moe_stage(setup);
  const std::size_t boundary = model->boundary_floats() * sizeof(float);
  stage_actor_args args{setup, std::move(model), &bulk, coord.ref, nullptr, {}, nullptr};
  auto stage = sys.spawn<stage_actor>(std::move(args));

  std::uint64_t epoch_after = 0;
  bool done = false;
  asio::co_spawn(
      io,
      [&]() -> awaitable<void> {
        // Epoch 1's activation before its Iterate, from node 9 (gone): the pull fails.
        (void)stage.tell<wire::Activation>([&](wire::Activation::Builder b) {
          b.setEpoch(1);
          b.setMicroBatch(0);
          transport::write_descriptor(b.initTensor(), {9, 1, 0, boundary});
        });
        (void)stage.tell<wire::Iterate>([](wire::Iterate::Builder b) {
          b.setIteration(0);
          b.setEpoch(1);
          b.setLossScale(1.0f);
        });
        // The recovery aborts epoch 1 everywhere, then the job goes on with epoch 2.
        auto ack =
            co_await stage.ask<wire::Abort>(30s, [](wire::Abort::Builder b) { b.setEpoch(1); });
        EXPECT_TRUE(ack.ok()) << ack.err().message;
        (void)stage.tell<wire::Iterate>([](wire::Iterate::Builder b) {
          b.setIteration(0);
          b.setEpoch(2);
          b.setLossScale(1.0f);
        });
        auto state = co_await stage.ask<wire::StageStateQuery>(30s);
        EXPECT_TRUE(state.ok()) << state.err().message;
        if (state.ok()) epoch_after = (**state).getEpoch();
        done = true;
        io.stop();
      },
      asio::detached);
  io.run_for(60s);
  io.restart();
  sys.shutdown();
  io.run_for(200ms);
  ASSERT_TRUE(done);
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_NE(failures[0].find("pull from node 9 failed"), std::string::npos) << failures[0];
  EXPECT_EQ(epoch_after, 2u) << "the stage dropped the Iterate after the abort";
}

}  // namespace
}  // namespace moevement::engine
