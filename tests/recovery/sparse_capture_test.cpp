// The moevement capture: W_sparse from Algorithm 1 or given, one slot per iteration tagged with
// its window, stale windows, logs and plans dropped (host memory bounded over a long run).
#include "recovery/sparse_capture.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <optional>

#include "engine/local_pipeline.hpp"
#include "tests/support/small_train.hpp"

namespace moevement::recovery {
namespace {

using test_support::test_train;

TEST(sparse_capture, w_sparse_from_the_profile_is_agreed_across_stages) {
  engine::local_pipeline pipe{models::preset("tiny"), test_train(), 2};
  std::vector<std::vector<models::operator_state*>> stages{pipe.stage(0, 0).operators(),
                                                           pipe.stage(1, 0).operators()};
  // unlimited bandwidth: every operator fits in one slot
  EXPECT_EQ(find_w_sparse(stages, 1.0, 1e18), 1);
  // a bandwidth where a whole stage's full state takes ~4 iterations needs a window > 1
  std::uint64_t full = 0;
  for (const auto* op : stages[0]) {
    const auto s = sparse_sizes(*op);
    full += s.master_bytes + s.optim_bytes;
  }
  const int w = find_w_sparse(stages, 1.0, double(full) / 4);
  EXPECT_GT(w, 1);
  for (const auto& ops : stages) {
    stage_schedule sched(sparse_config{0, 1.0, double(full) / 4}, ops);
    EXPECT_LE(sched.w_sparse(), w);
    EXPECT_EQ(sim::check_schedule(sched.window_schedule(0), ops.size()), "");
  }
  EXPECT_THROW(stage_schedule(sparse_config{}, stages[0]), std::invalid_argument);
}

TEST(sparse_capture, slots_are_tagged_and_memory_stays_bounded) {
  constexpr int w = 3;
  const auto t = test_train();
  engine::local_pipeline pipe{models::preset("tiny"), t, 2};
  stage_schedule s0(sparse_config{w}, pipe.stage(0, 0).operators());
  stage_schedule s1(sparse_config{w}, pipe.stage(1, 0).operators());
  sparse_capture c0(s0, 0, 0, &pipe.scaler()), c1(s1, 1, 0, &pipe.scaler());
  pipe.set_hooks(0, 0, &c0);
  pipe.set_hooks(1, 0, &c1);
  const std::size_t tensor = pipe.stage(0, 0).boundary_floats() * sizeof(float);
  // Buffers of at most two windows (persisted + in flight, recycled), each slot at most the
  // whole stage in full.
  const auto ops0 = pipe.stage(0, 0).operators();
  const std::vector<const models::operator_state*> cops(ops0.begin(), ops0.end());
  const std::vector<capture_kind> all_full(cops.size(), capture_kind::full);
  const std::size_t snapshot_bound = 2 * w * snapshot_size(cops, all_full);
  for (int i = 0; i < 8 * w + 1; ++i) {
    pipe.train_iteration();
    if (i < w - 1) {
      EXPECT_FALSE(c0.persisted().has_value());
      continue;
    }
    const auto v = c1.persisted();
    ASSERT_TRUE(v.has_value());
    EXPECT_EQ(v->window, std::uint64_t((i + 1) / w - 1));
    EXPECT_EQ(v->first_iteration, std::int64_t(v->window) * w + 1);
    for (std::size_t j = 0; j < v->slots.size(); ++j) {
      const auto tag = parse_snapshot(v->slots[j]).tag;
      EXPECT_EQ(tag, (snapshot_tag{v->window, std::uint32_t(j),
                                   v->first_iteration + std::int64_t(j), 1, 0}));
    }
    // one persisted window and one in flight; logs and plans from the persisted window on
    EXPECT_LE(c1.windows_held(), 2u);
    EXPECT_GE(c1.log().span_held()->first, std::uint64_t(v->first_iteration));
    EXPECT_GE(c0.steps().begin()->first, v->first_iteration);
    EXPECT_LE(c0.log().bytes(), std::size_t(2 * w * t.micro_batches) * tensor);
    EXPECT_LE(c1.log().bytes(), std::size_t(2 * w * t.micro_batches) * tensor);
    EXPECT_EQ(c0.log_conflicts(), 0u);
    EXPECT_LE(c0.snapshot_bytes_held(), snapshot_bound) << "iteration " << i;
  }
  EXPECT_GT(c0.last_slot_bytes(), 0u);
}

TEST(sparse_capture, a_capture_started_mid_window_waits_for_the_next) {
  const auto t = test_train();
  engine::local_pipeline pipe{models::preset("tiny"), t, 1};
  stage_schedule sched(sparse_config{4}, pipe.stage(0, 0).operators());
  pipe.train_iteration();  // iteration 0 not captured
  sparse_capture cap(sched, 0, 0, &pipe.scaler());
  pipe.set_hooks(0, 0, &cap);
  for (int i = 1; i < 8; ++i) pipe.train_iteration();
  // window 0 (iterations 0..3) missed its slot 0; window 1 (4..7) is complete
  ASSERT_TRUE(cap.persisted().has_value());
  EXPECT_EQ(cap.persisted()->window, 1u);
  EXPECT_EQ(cap.windows_held(), 1u);
}

// Section 3.2: each slot is smaller than a dense snapshot of the stage (full state of every
// operator); the sizes are printed for docs/sparse-checkpointing.md.
// The actor version copies outside its lock: begin_capture, write, end_capture make the same
// slot as after_step, and the slot is not offered (slot_of) before it is written.
TEST(sparse_capture, a_capture_in_three_parts_makes_the_same_slot) {
  engine::local_pipeline pipe{models::preset("tiny"), test_train(), 2};
  const auto ops = pipe.stage(0, 0).operators();
  stage_schedule sched(sparse_config{2}, ops);
  sparse_capture whole(sched, 0, 0, &pipe.scaler()), parts(sched, 0, 0, &pipe.scaler());
  for (std::int64_t it = 0; it < 4; ++it) {
    pipe.train_iteration();
    whole.after_step(it, ops);
    auto job = parts.begin_capture(it, ops);
    ASSERT_TRUE(job.has_value()) << it;
    EXPECT_EQ(job->device, nullptr);  // a CPU stage: from the host operators
    EXPECT_FALSE(parts.slot_of(it).has_value()) << "offered before it was written";
    job->write();
    parts.end_capture(*job);
    const auto a = whole.slot_of(it), b = parts.slot_of(it);
    ASSERT_TRUE(a && b) << it;
    EXPECT_TRUE(std::equal(a->begin(), a->end(), b->begin(), b->end())) << it;
  }
  EXPECT_TRUE(parts.persisted().has_value());
  EXPECT_EQ(parts.persisted()->window, whole.persisted()->window);
}

TEST(sparse_capture, slots_are_smaller_than_a_dense_snapshot) {
  constexpr int w = 3;
  engine::local_pipeline pipe{models::preset("tiny"), test_train(), 1};
  const auto ops = pipe.stage(0, 0).operators();
  stage_schedule sched(sparse_config{w}, ops);
  sparse_capture cap(sched, 0, 0, &pipe.scaler());
  pipe.set_hooks(0, 0, &cap);
  for (int i = 0; i < w; ++i) pipe.train_iteration();
  const std::vector<const models::operator_state*> cops(ops.begin(), ops.end());
  const std::size_t dense =
      snapshot_size(cops, std::vector<capture_kind>(cops.size(), capture_kind::full));
  const auto v = cap.persisted();
  ASSERT_TRUE(v.has_value());
  std::cout << "tiny, one stage, W=" << w << ": dense snapshot " << dense << " bytes; slots";
  for (const auto slot : v->slots) {
    EXPECT_LT(slot.size(), dense);
    std::cout << " " << slot.size();
  }
  std::cout << "\n";
}

// Appendix B's orderings: two experts A and B of one stage whose counts make the orderings
// disagree. Window 0 (W = 2) holds iterations 0 and 1; window 1's schedule orders by window 0.
struct two_experts {
  engine::local_pipeline pipe{models::preset("tiny"), test_train(), 1};
  std::vector<models::operator_state*> ops = pipe.stage(0, 0).operators();
  std::size_t a = 0, b = 0;  // the first two experts
  two_experts() {
    std::vector<std::size_t> experts;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (ops[i]->kind() == models::op_kind::expert) experts.push_back(i);
    }
    a = experts.at(0);
    b = experts.at(1);
  }
  // Which of A and B window 1 snapshots in full first (the less popular one).
  std::size_t first_of_window_1(const sparse_config& c, const std::vector<double>& a_counts,
                                const std::vector<double>& b_counts) {
    stage_schedule sched(c, ops);
    for (std::int64_t it = 0; it < 2; ++it) {
      std::vector<double> counts(ops.size(), 50.0);  // every other expert in between
      counts[a] = a_counts[std::size_t(it)];
      counts[b] = b_counts[std::size_t(it)];
      sched.add_counts(it, counts);
    }
    const auto& w1 = sched.window_schedule(1);
    for (const auto& slot : w1) {
      for (std::size_t i : slot.active) {
        if (i == a || i == b) return i;
      }
    }
    return ops.size();
  }
};

TEST(sparse_orderings, names_parse_and_unknown_ones_are_refused) {
  for (auto o : {ordering::popularity, ordering::soft_count, ordering::time_decayed,
                 ordering::capacity_aware}) {
    EXPECT_EQ(parse_ordering(ordering_name(o)), o);
  }
  EXPECT_THROW(parse_ordering("random"), std::invalid_argument);
}

TEST(sparse_orderings, time_decayed_favours_recent_counts) {
  two_experts x;
  sparse_config c{2};
  // A: 100 then 0; B: 0 then 60. Summed, A (100) is more popular; with alpha = 0.5 the
  // moving average ends at A 25, B 30.
  EXPECT_EQ(x.first_of_window_1(c, {100, 0}, {0, 60}), x.b);
  c.order_by = ordering::time_decayed;
  c.decay_alpha = 0.5;
  EXPECT_EQ(x.first_of_window_1(c, {100, 0}, {0, 60}), x.a);
}

TEST(sparse_orderings, capacity_aware_divides_by_each_experts_capacity) {
  two_experts x;
  sparse_config c{2};
  EXPECT_EQ(x.first_of_window_1(c, {50, 50}, {30, 30}), x.b);  // B routed fewer tokens
  c.order_by = ordering::capacity_aware;
  c.capacities.assign(x.ops.size(), 100.0);
  c.capacities[x.b] = 30.0;  // B is small and full; A has room
  EXPECT_EQ(x.first_of_window_1(c, {50, 50}, {30, 30}), x.a);
  c.capacities.assign(3, 1.0);
  EXPECT_THROW(stage_schedule(c, x.ops), std::invalid_argument);
}

TEST(sparse_orderings, soft_count_orders_by_gate_probabilities) {
  two_experts x;
  // The gate before A and B routed more tokens to A but gave B more probability mass.
  std::size_t gate = x.ops.size();
  for (std::size_t i = x.a; i-- > 0;) {
    if (x.ops[i]->kind() == models::op_kind::gate) {
      gate = i;
      break;
    }
  }
  ASSERT_LT(gate, x.ops.size());
  const auto order_first = [&](const sparse_config& c) {
    stage_schedule sched(c, x.ops);
    for (std::int64_t it = 0; it < 2; ++it) {
      auto& routed = x.ops[gate]->routed_tokens();
      auto& probs = x.ops[gate]->prob_sums();
      std::fill(routed.begin(), routed.end(), 50);
      std::fill(probs.begin(), probs.end(), 5.0);
      routed[0] = 90;  // A
      routed[1] = 10;  // B
      probs[0] = 1.0;
      probs[1] = 9.0;
      sched.add_popularity(it, x.ops);
    }
    for (const auto& slot : sched.window_schedule(1)) {
      for (std::size_t i : slot.active) {
        if (i == x.a || i == x.b) return i;
      }
    }
    return x.ops.size();
  };
  sparse_config c{2};
  EXPECT_EQ(order_first(c), x.b);
  c.order_by = ordering::soft_count;
  EXPECT_EQ(order_first(c), x.a);
  // what a stage reports under launch follows the same choice
  EXPECT_EQ(engine::operator_popularity(x.ops, false)[x.a], 90.0);
  EXPECT_EQ(engine::operator_popularity(x.ops, true)[x.a], 1.0);
}

TEST(sparse_orderings, a_saved_state_schedules_the_next_windows_identically) {
  // A replacement takes over a survivor's state: both then fix the same schedules.
  for (auto o : {ordering::popularity, ordering::time_decayed}) {
    two_experts x;
    sparse_config c{2};
    c.order_by = o;
    c.decay_alpha = 0.5;
    stage_schedule survivor(c, x.ops), fresh(c, x.ops), taken(c, x.ops);
    for (std::int64_t it = 0; it < 5; ++it) {
      std::vector<double> counts(x.ops.size(), double(it * 7 % 5));
      counts[x.a] = double(100 - 20 * it);
      counts[x.b] = double(10 * it);
      survivor.add_counts(it, counts);
      if (it == 4) continue;  // a replacement starts at iteration 4
      (void)survivor.window_schedule(std::uint64_t(it / 2));
    }
    taken.load(survivor.save());
    for (std::int64_t it = 5; it < 9; ++it) {
      std::vector<double> counts(x.ops.size(), 3.0);
      counts[x.a] = double(it);
      counts[x.b] = double(50 - it);
      for (auto* s : {&survivor, &taken}) {
        if (it % 2 == 0) (void)s->window_schedule(std::uint64_t(it / 2));
        s->add_counts(it, counts);
      }
    }
    for (std::uint64_t w = 3; w <= 4; ++w) {
      const auto& ws = survivor.window_schedule(w);
      const auto& wt = taken.window_schedule(w);
      ASSERT_EQ(ws.size(), wt.size());
      for (std::size_t j = 0; j < ws.size(); ++j) {
        EXPECT_EQ(ws[j].active, wt[j].active) << ordering_name(o) << " window " << w;
        EXPECT_EQ(ws[j].frozen, wt[j].frozen) << ordering_name(o) << " window " << w;
      }
    }
    auto bad = survivor.save();
    bad.order.pop_back();
    EXPECT_THROW(fresh.load(bad), std::invalid_argument);
  }
}

}  // namespace
}  // namespace moevement::recovery

namespace moevement::recovery {
namespace {

// After a recovery resumes at iteration R, the windows that can no longer be persisted (all
// their slots captured before R, newer than the persisted one) stop counting against the bound
// on windows held, so that the next window does not stall on them; their buffers stay (a
// replicator may still be reading a slot) until the next persisted window drops them.
TEST(sparse_capture, a_recovery_abandons_the_windows_that_can_no_longer_persist) {
  const auto t = test_train();
  engine::local_pipeline pipe{models::preset("tiny"), t, 1};
  stage_schedule sched(sparse_config{1}, pipe.stage(0, 0).operators());
  sparse_capture cap(0, 0);  // distributed: windows persist only when the job says so
  cap.set_schedule(sched);
  pipe.set_hooks(0, 0, &cap);
  for (int i = 0; i < 7; ++i) pipe.train_iteration();  // windows 0..6, first iterations 1..7
  cap.drop_before(1, 2);                               // window 1 persisted (the recovery's window)
  EXPECT_EQ(cap.windows_held(), 6u);
  // resumed at iteration 6: windows 2..5 were captured by steps 2..5, window 6 by step 6
  EXPECT_EQ(cap.abandon_ended_before(6), 4u);
  EXPECT_EQ(cap.windows_held(), 2u) << "the persisted window and window 6";
  EXPECT_TRUE(cap.complete(5)) << "abandoned windows keep their buffers";
  EXPECT_EQ(cap.abandon_ended_before(6), 0u) << "marked once";
  pipe.train_iteration();  // window 7
  EXPECT_EQ(cap.windows_held(), 3u);
  cap.drop_before(7, 8);  // the next persisted window frees them
  EXPECT_FALSE(cap.complete(5));
  EXPECT_EQ(cap.windows_held(), 1u);
  pipe.set_hooks(0, 0, nullptr);
}

// A window the head retains (a shadow check replays from it) stays past newer persisted ones,
// with the logs and step plans from the first iteration it names, and counts in no bound on
// windows held; once no longer retained the next persisted window drops it.
TEST(sparse_capture, a_retained_window_stays_with_its_logs_until_released) {
  const auto t = test_train();
  engine::local_pipeline pipe{models::preset("tiny"), t, 2};  // stage 0 sends: its log
  stage_schedule sched(sparse_config{1}, pipe.stage(0, 0).operators());
  sparse_capture cap(0, 0);
  cap.set_schedule(sched);
  pipe.set_hooks(0, 0, &cap);
  for (int i = 0; i < 6; ++i) pipe.train_iteration();  // windows 0..5, first iterations 1..6
  const std::size_t sends = cap.log().entries();
  ASSERT_GT(sends, 0u);
  cap.drop_before(4, 5, {1}, 2);
  EXPECT_TRUE(cap.complete(1));
  EXPECT_FALSE(cap.complete(2));
  EXPECT_EQ(cap.windows_held(), 2u) << "windows 4 and 5: the retained one is not counted";
  EXPECT_FALSE(cap.steps().empty());
  EXPECT_EQ(cap.steps().begin()->first, 2) << "plans from the retained first iteration";
  const std::size_t kept = cap.log().entries();
  cap.drop_before(5, 6);
  EXPECT_FALSE(cap.complete(1)) << "released";
  EXPECT_LT(cap.log().entries(), kept);
  pipe.set_hooks(0, 0, nullptr);
}

// W = 2, resumed mid-window: the window spanning the resume point is lost whole (the
// replacement joins no window mid-way); a marked window that is persisted after all (its
// slots were all replicated before the loss) counts again.
TEST(sparse_capture, a_recovery_mid_window_abandons_the_window_it_splits) {
  const auto t = test_train();
  engine::local_pipeline pipe{models::preset("tiny"), t, 1};
  stage_schedule sched(sparse_config{2}, pipe.stage(0, 0).operators());
  sparse_capture cap(0, 0);
  cap.set_schedule(sched);
  pipe.set_hooks(0, 0, &cap);
  for (int i = 0; i < 8; ++i) pipe.train_iteration();  // windows 0..3, first iterations 1,3,5,7
  cap.drop_before(0, 1);
  EXPECT_EQ(cap.windows_held(), 4u);
  // resumed at 5: window 2 (steps 4 and 5) was split by the loss, window 1 ended before
  EXPECT_EQ(cap.abandon_ended_before(5), 2u);
  EXPECT_EQ(cap.windows_held(), 2u) << "windows 0 and 3";
  cap.drop_before(2, 5);  // window 2 persisted after all
  EXPECT_EQ(cap.windows_held(), 2u) << "windows 2 and 3";
  EXPECT_FALSE(cap.complete(1));
  pipe.set_hooks(0, 0, nullptr);
}

// A standby head's windows begin where it took over, part of the way through a window its lost
// head began (W 2: window 100 of steps 200-201 got step 200, then window 101 begins at step
// 201). A step's slot is where it was captured: the newest window holding the step, not the
// older, abandoned one (whose slot 1 stays empty: no window would ever be offered again).
TEST(sparse_capture, a_step_in_two_overlapping_windows_is_in_the_newer) {
  engine::local_pipeline pipe{models::preset("tiny"), test_train(), 2};
  const auto ops = pipe.stage(0, 0).operators();
  stage_schedule sched(sparse_config{2}, ops);
  sparse_capture cap(0, 0);
  cap.set_schedule(sched);
  auto capture = [&](std::int64_t step, engine::checkpoint_place place) {
    auto job = cap.begin_capture(step, ops, place);
    ASSERT_TRUE(job.has_value()) << step;
    job->write();
    cap.end_capture(*job);
  };
  pipe.train_iteration();
  capture(198, {2, 99, 0});
  capture(199, {2, 99, 1});
  cap.drop_before(99, 199);   // window 99 persisted
  capture(200, {2, 100, 0});  // the lost head's last Step
  EXPECT_EQ(cap.abandon_ended_before(201), 1u) << "window 100, which the takeover splits";
  capture(201, {2, 101, 0});  // the standby's first window
  const auto at = cap.place_of(201);
  ASSERT_TRUE(at.has_value());
  EXPECT_EQ(at->window, 101u);
  EXPECT_EQ(at->slot, 0u);
  EXPECT_TRUE(cap.slot_of(201).has_value()) << "the slot captured, to ship";
  EXPECT_EQ(cap.place_of(200)->window, 100u);
  capture(202, {2, 101, 1});
  EXPECT_TRUE(cap.complete(101));
  EXPECT_FALSE(cap.complete(100));
}

// A lender of slot memory (what slot_pool is for a distributed stage), from blocks the test
// owns: it misses its first asks (the capture then uses the heap), lends afterwards, and
// counts what comes back.
struct test_lender {
  struct block {
    std::unique_ptr<std::byte[]> memory;
    std::size_t size = 0;
    bool lent = false;
  };
  std::vector<std::unique_ptr<block>> blocks;
  int misses_left = 2;
  int asks = 0, returns = 0;
  std::optional<slot_memory> take(std::size_t n) {
    ++asks;
    if (misses_left > 0) {
      --misses_left;
      return std::nullopt;
    }
    // More than asked for, as a pool's best fit may be: the capture must use only n.
    auto& b = *blocks.emplace_back(std::make_unique<block>());
    b.size = n + 64;
    b.memory = std::make_unique<std::byte[]>(b.size);
    b.lent = true;
    std::shared_ptr<void> owner(static_cast<void*>(b.memory.get()), [this, &b](void*) {
      b.lent = false;
      ++returns;
    });
    return slot_memory{{b.memory.get(), b.size}, std::move(owner), true};
  }
  bool lent(const std::byte* p) const {
    for (const auto& b : blocks) {
      if (b->lent && p >= b->memory.get() && p < b->memory.get() + b->size) return true;
    }
    return false;
  }
  std::size_t lent_blocks() const {
    std::size_t n = 0;
    for (const auto& b : blocks) n += b->lent;
    return n;
  }
};

// Slots in lent memory hold the same bytes as heap ones; heap slots move to lent memory once
// the lender has some; the capture's memory stays bounded and all of it goes back.
TEST(sparse_capture, lent_slot_memory_holds_the_same_bytes_and_goes_back) {
  constexpr int w = 2;
  const auto t = test_train();
  engine::local_pipeline heap_pipe{models::preset("tiny"), t, 1};
  engine::local_pipeline lent_pipe{models::preset("tiny"), t, 1};
  stage_schedule heap_sched(sparse_config{w}, heap_pipe.stage(0, 0).operators());
  stage_schedule lent_sched(sparse_config{w}, lent_pipe.stage(0, 0).operators());
  test_lender lender;
  {
    sparse_capture heap_cap(heap_sched, 0, 0, &heap_pipe.scaler());
    sparse_capture lent_cap(lent_sched, 0, 0, &lent_pipe.scaler());
    lent_cap.set_allocator([&](std::size_t n) { return lender.take(n); });
    heap_pipe.set_hooks(0, 0, &heap_cap);
    lent_pipe.set_hooks(0, 0, &lent_cap);
    for (int i = 0; i < 6 * w; ++i) {
      heap_pipe.train_iteration();
      lent_pipe.train_iteration();
      const auto a = heap_cap.slot_of(i), b = lent_cap.slot_of(i);
      ASSERT_TRUE(a && b);
      ASSERT_EQ(a->size(), b->size());
      EXPECT_TRUE(std::equal(a->begin(), a->end(), b->begin())) << "iteration " << i;
      // The first two asks missed (window 0 on the heap); from window 1 on every slot is lent.
      EXPECT_EQ(lender.lent(b->data()), i >= w) << "iteration " << i;
    }
    EXPECT_GE(lender.asks, 2 * w) << "heap slots ask again at the next window";
    EXPECT_LE(lender.lent_blocks(), std::size_t(2 * w)) << "two windows' slots, recycled";
    EXPECT_GT(lent_cap.snapshot_bytes_held(), heap_cap.snapshot_bytes_held())
        << "counts the lent capacity";
    heap_pipe.set_hooks(0, 0, nullptr);
    lent_pipe.set_hooks(0, 0, nullptr);
  }
  EXPECT_EQ(lender.lent_blocks(), 0u) << "the capture gave all of it back";
  EXPECT_EQ(lender.returns, int(lender.blocks.size()));
}

// Persisting lags the next capture by a slot (the usual case: a window's persist arrives after
// the next window's first capture): window 2 begins while window 0 is still held and takes new
// memory for its first slot. When window 1 then persists, window 0's memory goes to window 2's
// remaining slot instead of back to the lender, and what is left stays as a spare: the
// capture keeps three windows' memory (the persisted, the persisting and the captured one), so
// the next windows take no new memory (with two, every window of W = 1 did).
TEST(sparse_capture, a_window_begun_before_the_last_was_dropped_takes_its_memory) {
  constexpr int w = 2;
  const auto t = test_train();
  engine::local_pipeline pipe{models::preset("tiny"), t, 1};
  stage_schedule sched(sparse_config{w}, pipe.stage(0, 0).operators());
  test_lender lender;
  lender.misses_left = 0;
  {
    sparse_capture cap(0, 0);
    cap.set_schedule(sched);
    cap.set_allocator([&](std::size_t n) { return lender.take(n); });
    pipe.set_hooks(0, 0, &cap);
    for (int i = 0; i < 2 * w; ++i) pipe.train_iteration();  // windows 0 and 1
    cap.drop_before(0, 1);
    EXPECT_EQ(lender.asks, 2 * w);
    const std::size_t two_windows = cap.snapshot_bytes_held();
    pipe.train_iteration();  // window 2's first slot, window 0 still held: new memory
    EXPECT_EQ(lender.asks, 2 * w + 1);
    EXPECT_TRUE(cap.last_slot_fresh()) << "new memory: its pages made as it was written";
    cap.drop_before(1, 3);  // window 1 persisted: window 0 dropped
    EXPECT_EQ(lender.returns, 0) << "window 0's second slot goes to window 2, its first is kept";
    pipe.train_iteration();  // window 2's second slot: window 0's memory, no ask
    EXPECT_EQ(lender.asks, 2 * w + 1);
    EXPECT_FALSE(cap.last_slot_fresh());
    EXPECT_TRUE(cap.complete(2));
    EXPECT_EQ(lender.lent_blocks(), std::size_t(2 * w + 1));
    EXPECT_GT(cap.snapshot_bytes_held(), two_windows);
    // Persisting one window behind: window 3 completes the third window's memory (one slot
    // new), and from then on no window takes new memory.
    for (int i = 0; i < w; ++i) pipe.train_iteration();
    EXPECT_EQ(lender.asks, 2 * w + 2);
    for (int k = 4; k < 7; ++k) {
      cap.drop_before(std::uint64_t(k - 2), 2 * (k - 2) + 1);
      for (int i = 0; i < w; ++i) {
        pipe.train_iteration();
        EXPECT_FALSE(cap.last_slot_fresh()) << "window " << k;
      }
    }
    EXPECT_EQ(lender.asks, 2 * w + 2);
    EXPECT_LE(lender.lent_blocks(), std::size_t(3 * w)) << "three windows' memory at most";
    pipe.set_hooks(0, 0, nullptr);
  }
  EXPECT_EQ(lender.lent_blocks(), 0u);
}

// Replication stuck (no window persists): the policy skips windows rather than hold more.
// A skipped window takes no memory and is never complete; the next one after a persist is
// captured as usual.
TEST(sparse_capture, a_skipped_window_takes_no_memory_and_the_next_is_captured) {
  constexpr int w = 2;
  const auto t = test_train();
  engine::local_pipeline pipe{models::preset("tiny"), t, 1};
  stage_schedule sched(sparse_config{w}, pipe.stage(0, 0).operators());
  sparse_capture cap(0, 0);
  cap.set_schedule(sched);
  pipe.set_hooks(0, 0, &cap);
  for (int i = 0; i < 3 * w; ++i) pipe.train_iteration();  // windows 0, 1, 2; none persisted
  const std::size_t held = cap.snapshot_bytes_held();
  cap.skip_window(1);  // begun already: not skipped
  EXPECT_EQ(cap.windows_skipped(), 0u);
  cap.skip_window(3);
  cap.skip_window(3);  // once
  EXPECT_EQ(cap.windows_skipped(), 1u);
  for (int i = 0; i < w; ++i) pipe.train_iteration();  // window 3: nothing captured
  EXPECT_FALSE(cap.slot_of(3 * w).has_value());
  EXPECT_FALSE(cap.complete(3));
  EXPECT_EQ(cap.windows_held(), 3u);
  EXPECT_EQ(cap.snapshot_bytes_held(), held);
  cap.drop_before(2, 2 * w + 1);  // window 2 persists after all
  pipe.train_iteration();         // window 4 is captured
  EXPECT_TRUE(cap.slot_of(4 * w).has_value());
  pipe.train_iteration();
  EXPECT_TRUE(cap.complete(4));
  pipe.set_hooks(0, 0, nullptr);
}

}  // namespace
}  // namespace moevement::recovery
