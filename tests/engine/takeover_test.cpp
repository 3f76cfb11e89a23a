// A standby head's takeover from the live stages (engine/takeover.hpp): where the stages agree
// training goes on at the next iteration with the loss scaler and step plans rebuilt from the
// journal and the stages; a Step that reached only some stages is completed; anything the
// stages disagree on is refused with the reason (the caller then goes to the durable tier).
#include "engine/takeover.hpp"

#include <capnp/message.h>
#include <gtest/gtest.h>

namespace moevement::engine {
namespace {

planned_step step(float scale, bool apply = true, float mul = 1.0f) {
  planned_step p;
  p.loss_scale = scale;
  p.plan.apply = apply;
  p.plan.grad_mul = mul;
  p.plan.grad_norm = 0.5;
  return p;
}

// The journal: durable windows 4 (iterations 8..) and 5 (10..), training at 12; steps 8..11.
resume_point journal() {
  resume_point p;
  p.window = 5;
  p.w_sparse = 2;
  p.target_iteration = 12;
  p.windows = {{4, 8}, {5, 10}};
  for (std::int64_t it = 8; it < 12; ++it) p.steps[it] = step(1.0f);
  return p;
}

// A stage that stepped `last`, keeping the steps from `from` on.
stage_state stepped_to(std::int64_t last, std::int64_t from = 10) {
  stage_state s;
  s.epoch = 40;
  s.stepped = last;
  s.wiring = 3;
  s.place = {2, 9, std::uint32_t(last % 2)};
  s.popularity = {1.0, 2.0};
  for (std::int64_t it = from; it <= last; ++it) s.steps[it] = step(1.0f);
  return s;
}

TEST(takeover, agreeing_stages_go_on_at_the_next_iteration) {
  std::vector<stage_state> s{stepped_to(15), stepped_to(15, 12), stepped_to(15)};
  s[1].dropped = true;
  s[2].epoch = 41;
  const auto t = plan_live_takeover(s, journal(), 3);
  ASSERT_TRUE(t.ok()) << t.err().message;
  EXPECT_EQ(t->target, 16);
  EXPECT_TRUE(t->dropped);
  EXPECT_EQ(t->epoch, 41u);
  EXPECT_EQ(t->wiring, 3u);
  EXPECT_EQ(t->next_window, 10u);  // past every stage's (and the journal's)
  EXPECT_EQ(t->w_sparse, 2);
  EXPECT_FALSE(t->unfinished);
  EXPECT_TRUE(t->drop.empty());
  ASSERT_EQ(t->steps.size(), 8u);  // the journal's 8..11 and the stages' 12..15
  EXPECT_EQ(t->steps.begin()->first, 8);
  EXPECT_EQ(t->steps.rbegin()->first, 15);
}

// The lost head's newest persisted window is the newest any stage holds (a window persists only
// once every stage replicated it); one older than the journal's is not the newest.
TEST(takeover, the_newest_persisted_window_any_stage_holds_is_the_jobs) {
  std::vector<stage_state> s{stepped_to(15), stepped_to(15), stepped_to(15)};
  s[0].persisted = std::pair<std::uint64_t, std::int64_t>{6, 12};
  s[1].persisted = std::pair<std::uint64_t, std::int64_t>{7, 14};  // heard of 7, the others not
  auto t = plan_live_takeover(s, journal(), 3);
  ASSERT_TRUE(t.ok()) << t.err().message;
  ASSERT_TRUE(t->persisted);
  EXPECT_EQ(*t->persisted, (std::pair<std::uint64_t, std::int64_t>{7, 14}));
  s[0].persisted = std::pair<std::uint64_t, std::int64_t>{4, 8};  // older than the journal's 5
  s[1].persisted.reset();
  t = plan_live_takeover(s, journal(), 3);
  ASSERT_TRUE(t.ok()) << t.err().message;
  EXPECT_FALSE(t->persisted);
}

TEST(takeover, reduced_gradients_of_an_iteration_nobody_stepped_are_dropped) {
  std::vector<stage_state> s{stepped_to(15), stepped_to(15)};
  s[1].reduced = true;
  s[1].epoch = 44;
  const auto t = plan_live_takeover(s, journal(), 2);
  ASSERT_TRUE(t.ok()) << t.err().message;
  EXPECT_EQ(t->target, 16);
  EXPECT_TRUE(t->dropped);
  ASSERT_EQ(t->drop.size(), 1u);
  EXPECT_EQ(t->drop[0], (std::pair<std::size_t, std::uint64_t>{1, 44}));
}

// pp 2, dp 2 (index d * pp + s): stage 0 replica 0 stepped 16, its replica 1 did not; stage 1
// replica 0 stepped, replica 1 did not. The lost head's Step goes to the two that lack it, each
// with what its own stage's stepped replica got.
TEST(takeover, a_step_that_reached_some_stages_is_sent_to_the_others) {
  std::vector<stage_state> s{stepped_to(16), stepped_to(16), stepped_to(15), stepped_to(15)};
  s[0].popularity = {1.0};
  s[1].popularity = {2.0};
  s[0].steps[16] = s[1].steps[16] = step(1.0f, true, 0.25f);
  s[2].reduced = s[3].reduced = true;
  const auto t = plan_live_takeover(s, journal(), 2);
  ASSERT_TRUE(t.ok()) << t.err().message;
  EXPECT_EQ(t->target, 17);
  EXPECT_FALSE(t->dropped);
  ASSERT_TRUE(t->unfinished);
  const auto& u = *t->unfinished;
  EXPECT_EQ(u.iteration, 16);
  EXPECT_EQ(u.epoch, 40u);
  EXPECT_EQ(u.step.plan.grad_mul, 0.25f);
  EXPECT_EQ(u.place.slot, 0u);
  EXPECT_EQ(u.stages, (std::vector<std::size_t>{2, 3}));
  EXPECT_EQ(u.popularity, (std::vector<std::vector<double>>{{1.0}, {2.0}}));
  EXPECT_EQ(t->steps.at(16).plan.grad_mul, 0.25f);

  // A stage behind that holds nothing of the step cannot take it.
  s[3].reduced = false;
  const auto refused = plan_live_takeover(s, journal(), 2);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.err().message.find("holds nothing of iteration 16"), std::string::npos);
}

TEST(takeover, what_the_stages_cannot_agree_on_is_refused_saying_why) {
  const auto why = [](std::vector<stage_state> s) {
    const auto t = plan_live_takeover(s, journal(), int(s.size()));
    return t.ok() ? std::string("ok") : t.err().message;
  };
  stage_state rebuilt = stepped_to(15);
  rebuilt.stepped.reset();
  EXPECT_NE(why({stepped_to(15), rebuilt}).find("stage 1 replica 0 was rebuilt"),
            std::string::npos);
  // Index d * pp + s: at pp 1 the second is replica 1 (the message said "stage replica 1").
  const auto one_stage = plan_live_takeover({stepped_to(15), rebuilt}, journal(), 1);
  ASSERT_FALSE(one_stage.ok());
  EXPECT_NE(one_stage.err().message.find("stage 0 replica 1 was rebuilt"), std::string::npos)
      << one_stage.err().message;
  EXPECT_NE(why({stepped_to(15), stepped_to(17)}).find("iterations 15 to 17"), std::string::npos);
  // Iterations 12..13 kept nowhere (the stages keep from 14).
  EXPECT_NE(why({stepped_to(15, 14), stepped_to(15, 14)}).find("iteration 12"), std::string::npos);
  stage_state other = stepped_to(15);
  other.steps[13] = step(1.0f, false);
  EXPECT_NE(why({stepped_to(15), other}).find("different step plans for iteration 13"),
            std::string::npos);
  EXPECT_NE(why({stepped_to(9), stepped_to(9)}).find("before the journal's 12"), std::string::npos);
  EXPECT_EQ(plan_live_takeover({}, journal(), 1).ok(), false);
}

// fp16's loss scaler before the target: the journal's, through each step since (a skipped step
// halves the scale, `window` good ones double it); a step whose scale does not follow is refused.
TEST(takeover, the_loss_scaler_is_the_journals_through_the_steps_since) {
  resume_point p = journal();
  p.scaler.enabled = true;
  p.scaler.scale = 1024.0f;
  p.scaler.good_steps = 1;
  p.scaler.window = 2;
  stage_state s = stepped_to(14, 12);
  s.steps[12] = step(1024.0f, true);   // good: 2 in a row, doubles to 2048
  s.steps[13] = step(2048.0f, false);  // overflow: halves to 1024
  s.steps[14] = step(1024.0f, true);
  auto t = plan_live_takeover({s}, p, 1);
  ASSERT_TRUE(t.ok()) << t.err().message;
  EXPECT_EQ(t->scaler.scale, 1024.0f);
  EXPECT_EQ(t->scaler.good_steps, 1);
  s.steps[14] = step(512.0f, true);
  t = plan_live_takeover({s}, p, 1);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.err().message.find("loss scale of iteration 14"), std::string::npos);
}

TEST(takeover, a_malformed_answer_is_refused) {
  capnp::MallocMessageBuilder msg;
  auto b = msg.initRoot<wire::StageState>();
  b.setKnown(true);
  b.setStepped(5);
  auto l = b.initSteps(2);
  l[0].setIteration(5);
  l[1].setIteration(5);
  EXPECT_THROW(read_stage_state(b.asReader()), std::invalid_argument);
  l[1].setIteration(6);
  const stage_state s = read_stage_state(b.asReader());
  EXPECT_EQ(s.stepped, std::optional<std::int64_t>{5});
  EXPECT_EQ(s.steps.size(), 2u);
}

}  // namespace
}  // namespace moevement::engine
