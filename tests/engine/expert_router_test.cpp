// The expert router's check of a peer's rows (ExpertRows, decoded): a message that does not fit
// this router is refused before anything is pulled or computed.
#include "engine/expert_router.hpp"

#include <gtest/gtest.h>

namespace moevement::engine {
namespace {

// EP rank 1 of 2, 4 experts per layer (2 per rank), rows of 8 floats, at most 64 floats, a
// stage of layers 2 and 3, 2 micro-batches.
constexpr expert_router_shape shape{1, 2, 4, 8, 64, 2, 4, 2};
constexpr std::size_t row = 8 * sizeof(float);

expert_request forward_of(std::vector<int> rows) {
  expert_request r;
  r.source = 0;
  r.layer = 2;
  r.mb = 1;
  r.rows = std::move(rows);
  return r;
}

TEST(expert_router, takes_rows_that_fit) {
  EXPECT_TRUE(expert_rows_fit(forward_of({3, 1}), 4 * row, shape));
  EXPECT_TRUE(expert_rows_fit(forward_of({0, 0}), 0, shape));  // no rows for this block
  auto val = forward_of({2, 2});
  val.mb = -1;  // a validation batch
  EXPECT_TRUE(expert_rows_fit(val, 4 * row, shape));
  expert_request back;
  back.backward = true;
  back.layer = 3;
  back.mb = 0;
  EXPECT_TRUE(expert_rows_fit(back, 5 * row, shape));
}

TEST(expert_router, refuses_rows_that_do_not_fit) {
  EXPECT_FALSE(expert_rows_fit(forward_of({3, 1}), 5 * row, shape));  // counts and tensor differ
  EXPECT_FALSE(expert_rows_fit(forward_of({4}), 4 * row, shape));     // one expert of two
  EXPECT_FALSE(expert_rows_fit(forward_of({5, -1}), 4 * row, shape));
  EXPECT_FALSE(expert_rows_fit(forward_of({3, 1}), 4 * row + 4, shape));  // not whole rows
  EXPECT_FALSE(expert_rows_fit(forward_of({6, 3}), 9 * row, shape));      // over the buffers
  auto self = forward_of({3, 1});
  self.source = 1;  // this router's own rank
  EXPECT_FALSE(expert_rows_fit(self, 4 * row, shape));
  auto outside = forward_of({3, 1});
  outside.source = 2;  // not in a group of 2
  EXPECT_FALSE(expert_rows_fit(outside, 4 * row, shape));
  for (const int l : {-1, 1, 4}) {  // not a layer of this stage
    auto layer = forward_of({3, 1});
    layer.layer = l;
    EXPECT_FALSE(expert_rows_fit(layer, 4 * row, shape)) << l;
  }
  for (const int m : {-2, 2}) {  // not a micro-batch of the iteration (nor validation's -1)
    auto mb = forward_of({3, 1});
    mb.mb = m;
    EXPECT_FALSE(expert_rows_fit(mb, 4 * row, shape)) << m;
  }
  expert_request back;
  back.backward = true;
  back.layer = 3;
  back.rows = {1, 1};  // a backward's rows are the forward's: it names none
  EXPECT_FALSE(expert_rows_fit(back, 2 * row, shape));
  back.rows.clear();
  back.mb = -1;  // validation has no backward
  EXPECT_FALSE(expert_rows_fit(back, 2 * row, shape));
}

}  // namespace
}  // namespace moevement::engine
