// NCCL groups of GPU ranks (models/cuda/collectives.hpp), each rank a process of its own on one
// GPU (NCCL_HOSTID tells them apart; they talk over NCCL's socket transport on the loopback):
// the chain sum gives the host's left fold bit for bit; a group whose peer never joins times
// out; a sum waiting on a hung peer returns, aborted, once told to stop. Needs a GPU: skips,
// saying why, without one. The test process itself never touches CUDA: a CUDA context does
// not survive fork(), so every rank (and the probe) is a child.
#include "models/cuda/collectives.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "models/cuda/device.hpp"
#include "models/rng.hpp"

namespace moevement::models {
namespace {

using clock = std::chrono::steady_clock;

// Runs body(rank, id) in `ranks` child processes (rank 0 makes the group id and hands it to
// the others through a pipe each); returns their exit codes, 128 + signal for a killed one.
// `meanwhile` (optional) runs in the parent while they do; it may reap children itself and
// record their codes in `codes` (index = rank), which the final wait then keeps.
struct ranks_run {
  std::vector<pid_t> pids;
  std::vector<int> codes;
};

int exit_code(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

[[noreturn]] void child_exit(bool ok, const std::string& why) {
  if (!ok) std::fprintf(stderr, "rank failed: %s\n", why.c_str());
  std::fflush(stderr);
  ::_exit(ok ? 0 : 1);
}

ranks_run run_ranks(int ranks, const std::function<void(int, std::span<const std::byte>)>& body,
                    const std::function<void(ranks_run&)>& meanwhile = {}) {
  std::vector<std::array<int, 2>> pipes(static_cast<std::size_t>(ranks));
  for (auto& p : pipes) EXPECT_EQ(::pipe(p.data()), 0);
  ranks_run out;
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const std::string host = "moevement-test-rank-" + std::to_string(r);
      ::setenv("NCCL_HOSTID", host.c_str(), 1);
      ::setenv("NCCL_SOCKET_IFNAME", "lo", 1);
      try {
        std::vector<std::byte> id(cuda::group_id_bytes);
        if (r == 0) {
          id = cuda::new_group_id();
          for (int o = 1; o < ranks; ++o) {
            if (::write(pipes[std::size_t(o)][1], id.data(), id.size()) != ssize_t(id.size())) {
              child_exit(false, "write id");
            }
          }
        } else if (::read(pipes[std::size_t(r)][0], id.data(), id.size()) != ssize_t(id.size())) {
          child_exit(false, "read id");
        }
        body(r, id);
      } catch (const std::exception& e) {
        child_exit(false, e.what());
      }
      child_exit(true, "");
    }
    out.pids.push_back(pid);
  }
  out.codes.assign(out.pids.size(), -1);  // -1: never reaped
  if (meanwhile) meanwhile(out);
  for (std::size_t r = 0; r < out.pids.size(); ++r) {
    int status = 0;
    if (out.codes[r] == -1 && ::waitpid(out.pids[r], &status, 0) == out.pids[r]) {
      out.codes[r] = exit_code(status);
    }
  }
  for (auto& p : pipes) {
    ::close(p[0]);
    ::close(p[1]);
  }
  return out;
}

// Whether a GPU is usable, asked in a child (see the header).
std::string no_gpu() {
  if (!cuda::compiled()) return "this build has no CUDA backend";
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(cuda::device_count() > 0 ? 0 : 1);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? "" : "no GPU on this machine";
}

std::vector<float> values(std::size_t n, std::uint64_t seed) {
  std::vector<float> v(n);
  const auto key = make_key({seed, 91});
  for (std::size_t i = 0; i < n; ++i) v[i] = float(2.0 * random_uniform(key, i) - 1.0);
  return v;
}

class cuda_collectives : public ::testing::Test {
 protected:
  void SetUp() override {
    static const std::string why = no_gpu();
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

TEST_F(cuda_collectives, the_chain_sum_is_the_host_fold_bit_for_bit) {
  const int ranks = 3;
  const std::vector<std::size_t> sizes = {1000, 37, 0, 4096};  // an empty one is skipped
  const auto run = run_ranks(ranks, [&](int r, std::span<const std::byte> id) {
    cuda::context ctx;
    cuda::nccl_group group(ctx, id, ranks, r);
    const std::atomic<bool> stop{false};
    const auto formed = group.wait_formed(clock::now() + std::chrono::seconds(60), stop);
    if (formed.end != cuda::wait_end::done) child_exit(false, "forming: " + formed.error);
    for (int round = 0; round < 2; ++round) {  // twice: the scratch and group are reused
      std::vector<std::unique_ptr<cuda::device_array<float>>> dev;
      std::vector<std::span<float>> spans;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        dev.push_back(std::make_unique<cuda::device_array<float>>(ctx, sizes[i]));
        if (sizes[i] > 0) dev.back()->upload(values(sizes[i], 100 * round + 10 * r + i));
        spans.emplace_back(dev.back()->data(), sizes[i]);
      }
      const auto w = group.sum(spans, stop);
      if (w.end != cuda::wait_end::done) child_exit(false, "sum: " + w.error);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        if (sizes[i] == 0) continue;
        // the host path: acc = g_d + (g_0 + ... + g_{d-1}), replica by replica
        std::vector<float> want = values(sizes[i], 100 * round + i);
        for (int d = 1; d < ranks; ++d) {
          const auto g = values(sizes[i], 100 * round + 10 * d + i);
          for (std::size_t k = 0; k < want.size(); ++k) want[k] = g[k] + want[k];
        }
        const auto got = dev[i]->download();
        if (std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) != 0) {
          child_exit(false, "buffer " + std::to_string(i) + " differs from the host fold");
        }
      }
    }
  });
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(run.codes[std::size_t(r)], 0) << "rank " << r;
}

TEST_F(cuda_collectives, a_group_whose_peer_never_joins_times_out) {
  const auto run = run_ranks(1, [](int, std::span<const std::byte> id) {
    cuda::context ctx;
    cuda::nccl_group group(ctx, id, 2, 0);  // rank 1 never comes
    const std::atomic<bool> stop{false};
    const auto w = group.wait_formed(clock::now() + std::chrono::seconds(2), stop);
    if (w.end != cuda::wait_end::timed_out) child_exit(false, "not a timeout: " + w.error);
    if (w.error.find("did not form") == std::string::npos) child_exit(false, w.error);
    if (w.seconds < 2.0) child_exit(false, "returned before the deadline");
    if (group.alive()) child_exit(false, "not aborted");
  });
  EXPECT_EQ(run.codes[0], 0);
}

TEST_F(cuda_collectives, a_sum_waiting_on_a_hung_peer_stops_when_told) {
  const auto run = run_ranks(
      2,
      [](int r, std::span<const std::byte> id) {
        cuda::context ctx;
        cuda::nccl_group group(ctx, id, 2, r);
        std::atomic<bool> stop{false};
        const auto formed = group.wait_formed(clock::now() + std::chrono::seconds(60), stop);
        if (formed.end != cuda::wait_end::done) child_exit(false, "forming: " + formed.error);
        cuda::device_array<float> g(ctx, 1 << 20);
        g.upload(values(1 << 20, 5));
        std::vector<std::span<float>> spans{{g.data(), g.size()}};
        if (r == 1) {
          ::raise(SIGSTOP);  // hung before its part of the sum; the parent kills it
          child_exit(false, "resumed");
        }
        std::thread stopper([&] {
          std::this_thread::sleep_for(std::chrono::seconds(1));
          stop = true;
        });
        const auto w = group.sum(spans, stop);
        stopper.join();
        if (w.end != cuda::wait_end::stopped) child_exit(false, "not stopped: " + w.error);
        if (group.alive()) child_exit(false, "not aborted");
      },
      [](ranks_run& run) {
        // rank 1 stops itself and stays stopped: once rank 0 has exited, kill it
        int status = 0;
        if (::waitpid(run.pids[0], &status, 0) == run.pids[0]) run.codes[0] = exit_code(status);
        ::kill(run.pids[1], SIGKILL);
      });
  EXPECT_EQ(run.codes[0], 0) << "rank 0";
  EXPECT_EQ(run.codes[1], 128 + SIGKILL);
}

}  // namespace
}  // namespace moevement::models
