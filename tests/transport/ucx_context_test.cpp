#include "transport/ucx_context.hpp"

#include <gtest/gtest.h>
#include <poll.h>

namespace moevement::transport {
namespace {

TEST(ucx_context, context_and_worker_come_up) {
  ucx_context context;
  ucx_worker worker(context);
  EXPECT_NE(context.handle(), nullptr);
  EXPECT_NE(worker.handle(), nullptr);
  EXPECT_GT(worker.address().size(), 0u);
  EXPECT_FALSE(ucx_version().empty());
}

TEST(ucx_context, armed_idle_worker_event_fd_stays_quiet) {
  ucx_context context;
  ucx_worker worker(context);
  const int fd = worker.event_fd();
  ASSERT_GE(fd, 0);
  while (worker.progress() != 0) {
  }
  ucs_status_t s;
  while ((s = ucp_worker_arm(worker.handle())) == UCS_ERR_BUSY) worker.progress();
  ASSERT_EQ(s, UCS_OK);
  pollfd p{fd, POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 20), 0) << "an idle worker signalled its event fd";
}

TEST(ucx_context, two_workers_in_one_process_are_distinct) {
  ucx_context context;
  ucx_worker a(context), b(context);
  EXPECT_NE(a.address(), b.address());
}

}  // namespace
}  // namespace moevement::transport
