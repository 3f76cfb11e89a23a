// ASSERT_* returns, which a coroutine cannot: CO_ASSERT co_returns instead (test bodies run on
// an actor system's executor).
#pragma once

#include <gtest/gtest.h>

#define CO_ASSERT(cond)                               \
  do {                                                \
    if (!(cond)) {                                    \
      ADD_FAILURE() << "assertion failed: " << #cond; \
      co_return;                                      \
    }                                                 \
  } while (0)
