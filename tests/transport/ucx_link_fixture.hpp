// The fixture of the multi-process ucx_link tests (ucx_link_test.cpp, ucx_link_bulk_test.cpp,
// one executable): this process is node 0; link_peer processes (spawned with posix_spawn,
// talking over 127.0.0.1) are the other nodes.
#pragma once
#include "transport/ucx_link.hpp"

#include <gtest/gtest.h>
#include <ucp/api/ucp.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <thread>

#include "base/hash.hpp"
#include "tests/transport/link_test_util.hpp"

extern char** environ;

namespace moevement::transport::link_tests {

using namespace std::chrono_literals;
using testing::decode;
using testing::encode;
using testing::test_message;

inline constexpr char token[] = "job-token-for-tests";

// Bytes of the big tensors: 1 GiB under meson test in the normal build
// (MOEVEMENT_TEST_TENSOR_BYTES, tests/transport/meson.build); 256 MiB by default, which the
// sanitizer build keeps (twice as slow there).
inline std::size_t tensor_bytes() {
  if (const char* v = std::getenv("MOEVEMENT_TEST_TENSOR_BYTES")) return std::stoull(v);
  return 256u << 20;
}

// At most 256 MiB: the kill tests need a pull still in flight when the exporter dies, not a
// big one (over TCP on loopback still a tenth of a second), and the path tests but one per
// transport check which path a pull takes; both take seconds off a suite that runs alone.
inline std::size_t capped_tensor_bytes() {
  return std::min<std::size_t>(tensor_bytes(), 256u << 20);
}

struct loss {
  node_id peer;
  peer_loss why;
  std::string detail;
};

class ucx_link_test : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    helper_ = std::getenv("MOEVEMENT_LINK_PEER") ? std::getenv("MOEVEMENT_LINK_PEER") : "";
    ASSERT_FALSE(helper_.empty()) << "run through meson test (MOEVEMENT_LINK_PEER names the "
                                     "link_peer helper)";
    if (tcp()) ::setenv("UCX_TLS", "tcp", 1);
    if (GetParam() == "sm") ::setenv("UCX_TLS", "sm,self", 1);
  }
  void TearDown() override {
    for (pid_t pid : children_) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    link_.reset();
    ::unsetenv("UCX_TLS");
  }
  bool tcp() const { return GetParam() == "tcp"; }

  void make_link(ucx_link_options o = {}) {
    o.self = 0;
    o.job_token = token;
    link_ = std::make_unique<ucx_link>(io_, o);
    link_->set_handlers(link_handlers{
        [this](node_id from, incoming_envelope env) { inbox_.emplace_back(from, decode(env)); },
        [this](node_id peer, peer_loss why, const std::string& detail) {
          losses_.push_back({peer, why, detail});
        }});
  }

  pid_t spawn(std::vector<std::string> args) {
    args.insert(args.begin(), helper_);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    EXPECT_EQ(::posix_spawn(&pid, helper_.c_str(), nullptr, nullptr, argv.data(), environ), 0);
    children_.push_back(pid);
    return pid;
  }
  std::vector<std::string> peer_args(const std::string& mode, node_id node,
                                     const std::string& tok = token) {
    return {mode, std::to_string(link_->port()), tok, std::to_string(node)};
  }

  template <class Pred>
  bool run_until(Pred pred, std::chrono::milliseconds limit = 20s) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!pred()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      io_.restart();
      io_.run_for(2ms);
    }
    return true;
  }

  // Runs the link while waiting for a child to exit; its exit status, or -1 on timeout.
  int wait_exit(pid_t pid, std::chrono::milliseconds limit = 20s) {
    int status = -1;
    const bool exited = run_until(
        [&] {
          int st = 0;
          if (::waitpid(pid, &st, WNOHANG) != pid) return false;
          status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
          return true;
        },
        limit);
    if (exited) std::erase(children_, pid);
    return exited ? status : -1;
  }

  std::optional<test_message> wait_message(const std::string& kind) {
    std::optional<test_message> found;
    run_until([&] {
      for (auto it = inbox_.begin(); it != inbox_.end(); ++it) {
        if (it->second.kind == kind) {
          found = it->second;
          inbox_.erase(it);
          return true;
        }
      }
      return false;
    });
    return found;
  }

  // Says bye to a peer and checks it leaves cleanly: goodbye seen here, exit status 0.
  void part(node_id peer, pid_t pid) {
    ASSERT_TRUE(link_->send(peer, encode(0, peer, testing::make("bye"))).ok());
    ASSERT_TRUE(run_until([&] { return !losses_.empty(); }));
    EXPECT_EQ(losses_.back().peer, peer);
    EXPECT_EQ(losses_.back().why, peer_loss::goodbye) << losses_.back().detail;
    EXPECT_EQ(wait_exit(pid), 0);
  }

  std::string helper_;
  asio::io_context io_;
  std::unique_ptr<ucx_link> link_;
  std::vector<std::pair<node_id, test_message>> inbox_;
  std::vector<loss> losses_;
  std::vector<pid_t> children_;
};

}  // namespace moevement::transport::link_tests
