// The training shape of the recovery unit tests: 2 micro-batches of 2 x 16 tokens, so that a
// pipeline of the tiny preset steps in milliseconds.
#pragma once

#include "models/config.hpp"

namespace moevement::test_support {

inline models::train_config test_train(int dp = 1) {
  models::train_config t;
  t.micro_batches = 2;
  t.micro_batch_size = 2;
  t.seq_len = 16;
  t.data_parallel = dp;
  return t;
}

}  // namespace moevement::test_support
