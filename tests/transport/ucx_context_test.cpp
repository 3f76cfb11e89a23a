#include "transport/ucx_context.hpp"

#include <gtest/gtest.h>
#include <poll.h>

#include <algorithm>
#include <string>
#include <vector>

namespace moevement::transport {
namespace {

TEST(ucx_context, ucx_tls_names_are_checked_against_the_hosts_transports) {
  const std::vector<std::string> here{"self", "tcp", "sysv", "posix", "cma"};
  EXPECT_TRUE(unavailable_transports("", here).empty());
  EXPECT_TRUE(unavailable_transports("tcp,sm,self", here).empty());
  EXPECT_TRUE(unavailable_transports("^rc", here).empty()) << "an exclusion names none";
  EXPECT_TRUE(unavailable_transports("all", here).empty());
  EXPECT_TRUE(unavailable_transports("shm,posix", here).empty());
  EXPECT_EQ(unavailable_transports("rc,sm,self", here), std::vector<std::string>{"rc"});
  EXPECT_EQ(unavailable_transports("dc_x,ud:aux,tcp", here),
            (std::vector<std::string>{"dc_x", "ud"}));
  EXPECT_EQ(unavailable_transports("tpc", here), std::vector<std::string>{"tpc"}) << "a typo";
  const std::vector<std::string> fabric{"self", "rc_mlx5", "ud_mlx5", "posix"};
  EXPECT_TRUE(unavailable_transports("rc,ud:aux,sm,self", fabric).empty());
  EXPECT_TRUE(unavailable_transports("ib,rc_x", fabric).empty());
  EXPECT_EQ(unavailable_transports("rc_v", fabric), std::vector<std::string>{"rc_v"});
}

TEST(ucx_context, this_hosts_transports_include_self_and_tcp) {
  const auto names = ucx_transports();
  EXPECT_NE(std::find(names.begin(), names.end(), "self"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "tcp"), names.end());
}

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
