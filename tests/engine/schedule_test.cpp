// 1F1B: the properties the engine relies on, for many (stage, stages, micro_batches).
#include "engine/schedule.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

namespace moevement::engine {
namespace {

TEST(schedule, one_f_one_b_properties) {
  for (int p = 1; p <= 8; ++p) {
    for (int s = 0; s < p; ++s) {
      for (int m = 1; m <= 12; ++m) {
        SCOPED_TRACE(testing::Message() << "stage " << s << " of " << p << ", m=" << m);
        const auto steps = one_f_one_b(s, p, m);
        ASSERT_EQ(steps.size(), std::size_t(2 * m));
        std::vector<int> fwd_at(m, -1), bwd_at(m, -1);
        int in_flight = 0, max_in_flight = 0, last_bwd = -1;
        for (int i = 0; i < int(steps.size()); ++i) {
          const auto& st = steps[std::size_t(i)];
          ASSERT_GE(st.micro_batch, 0);
          ASSERT_LT(st.micro_batch, m);
          if (st.what == pass::forward) {
            EXPECT_EQ(fwd_at[st.micro_batch], -1) << "forward twice";
            fwd_at[st.micro_batch] = i;
            max_in_flight = std::max(max_in_flight, ++in_flight);
          } else {
            EXPECT_EQ(bwd_at[st.micro_batch], -1) << "backward twice";
            bwd_at[st.micro_batch] = i;
            EXPECT_GE(fwd_at[st.micro_batch], 0) << "backward before its forward";
            EXPECT_EQ(st.micro_batch, last_bwd + 1) << "backwards out of micro-batch order";
            last_bwd = st.micro_batch;
            --in_flight;
          }
        }
        EXPECT_EQ(in_flight, 0);
        // forwards also in order, and the warmup is min(p - s - 1, m) forwards
        int warm = 0;
        while (warm < int(steps.size()) && steps[std::size_t(warm)].what == pass::forward) ++warm;
        EXPECT_EQ(warm, std::min(p - s, m)) << "warmup + the first steady forward";
        for (int mb = 1; mb < m; ++mb) EXPECT_LT(fwd_at[mb - 1], fwd_at[mb]);
        EXPECT_LE(max_in_flight, p - s);
        EXPECT_EQ(max_in_flight, std::min(p - s, m));
      }
    }
  }
}

TEST(schedule, last_stage_alternates_and_first_stage_of_two) {
  const std::vector<pipeline_step> last = {
      {pass::forward, 0}, {pass::backward, 0}, {pass::forward, 1}, {pass::backward, 1}};
  EXPECT_EQ(one_f_one_b(1, 2, 2), last);
  const std::vector<pipeline_step> first = {{pass::forward, 0},  {pass::forward, 1},
                                            {pass::backward, 0}, {pass::forward, 2},
                                            {pass::backward, 1}, {pass::backward, 2}};
  EXPECT_EQ(one_f_one_b(0, 2, 3), first);
}

TEST(schedule, bad_arguments_throw) {
  EXPECT_THROW(one_f_one_b(-1, 2, 4), std::invalid_argument);
  EXPECT_THROW(one_f_one_b(2, 2, 4), std::invalid_argument);
  EXPECT_THROW(one_f_one_b(0, 0, 4), std::invalid_argument);
  EXPECT_THROW(one_f_one_b(0, 2, 0), std::invalid_argument);
}

}  // namespace
}  // namespace moevement::engine
