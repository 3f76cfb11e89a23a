#include "recovery/atomic_file.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <string>

namespace moevement::recovery {
namespace {

class atomic_file : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        std::filesystem::temp_directory_path() / ("atomic_file_test_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::size_t entries() const {
    std::size_t n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir_)) ++n;
    return n;
  }
  std::filesystem::path dir_;
};

std::vector<std::byte> filled(std::size_t n, unsigned char v) {
  return std::vector<std::byte>(n, std::byte{v});
}

TEST_F(atomic_file, writes_replaces_and_leaves_no_temp_file) {
  const auto target = dir_ / "window.bin";
  write_file_atomically(target, filled(1000, 0xaa));
  write_file_atomically(target, filled(10, 0xbb));
  auto back = read_whole_file(target);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, filled(10, 0xbb));
  EXPECT_EQ(entries(), 1u);
}

TEST_F(atomic_file, missing_directory_throws_and_names_it) {
  try {
    write_file_atomically(dir_ / "no" / "such" / "x.bin", filled(1, 1));
    FAIL() << "expected a throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no/such"), std::string::npos) << e.what();
  }
}

TEST_F(atomic_file, writer_killed_mid_write_leaves_the_old_file_whole) {
  const auto target = dir_ / "window.bin";
  const auto old_bytes = filled(4096, 0x11);
  write_file_atomically(target, old_bytes);
  for (int attempt = 0; attempt < 5; ++attempt) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // 64 MiB writes take long enough to be killed part way.
      const auto big = filled(64u << 20, 0x22);
      for (;;) write_file_atomically(target, big);
    }
    ::usleep(20000 + attempt * 15000);
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    auto back = read_whole_file(target);
    ASSERT_TRUE(back.ok());
    // Either the old content or a complete new one, never a prefix.
    const bool is_old = *back == old_bytes;
    const bool is_new = back->size() == (64u << 20) && (*back)[0] == std::byte{0x22} &&
                        back->back() == std::byte{0x22};
    EXPECT_TRUE(is_old || is_new) << "torn file of " << back->size() << " bytes";
  }
}

TEST_F(atomic_file, reading_a_missing_file_is_an_error_not_a_throw) {
  auto r = read_whole_file(dir_ / "absent.bin");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.err().message.find("absent.bin"), std::string::npos);
}

}  // namespace
}  // namespace moevement::recovery
