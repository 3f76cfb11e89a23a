#include "models/cuda/device.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <string>

namespace moevement::models::cuda {
namespace {

TEST(cuda_device, saxpy_runs_on_the_gpu_and_is_reproducible) {
  if (!compiled()) GTEST_SKIP() << "CUDA backend not compiled into this build";
  if (device_count() == 0) GTEST_SKIP() << "no GPU on this machine: " << describe_device();
  std::vector<float> x(1 << 20), y(1 << 20);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(i % 977) * 0.001f;
    y[i] = static_cast<float>(i % 13) - 6.0f;
  }
  const auto r1 = saxpy(1.5f, x, y);
  const auto r2 = saxpy(1.5f, x, y);
  ASSERT_EQ(r1.size(), x.size());
  for (std::size_t i = 0; i < x.size(); i += 4099) {
    // One rounding per op, no FMA: exactly what the CPU computes in two steps.
    const float expect = (1.5f * x[i]) + y[i];
    EXPECT_EQ(r1[i], expect) << i;
  }
  EXPECT_EQ(std::memcmp(r1.data(), r2.data(), r1.size() * sizeof(float)), 0);
}

// cuBLASLt (half a gigabyte) is opened on first use, not when a process starts: a process that
// never runs a GPU GEMM (every CPU job's) does not pay for loading it. Needs no GPU.
TEST(cuda_device, cublaslt_is_opened_on_first_use_not_at_start) {
  if (!compiled()) GTEST_SKIP() << "CUDA backend not compiled into this build";
  const auto mapped = [] {
    std::ifstream maps("/proc/self/maps");
    const std::string all((std::istreambuf_iterator<char>(maps)), std::istreambuf_iterator<char>());
    return all.find("libcublasLt") != std::string::npos;
  };
  EXPECT_FALSE(mapped()) << "loaded at the process's start";
  EXPECT_EQ(open_cublaslt(), "");
  EXPECT_TRUE(mapped());
}

TEST(cuda_device, without_a_backend_the_error_says_what_to_do) {
  if (compiled()) GTEST_SKIP() << "CUDA backend is compiled in";
  EXPECT_EQ(device_count(), 0);
  EXPECT_THROW(saxpy(1.0f, {1.0f}, {1.0f}), std::runtime_error);
}

}  // namespace
}  // namespace moevement::models::cuda
