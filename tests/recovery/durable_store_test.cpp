#include "recovery/durable_store.hpp"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <fstream>

#include "base/hash.hpp"

namespace moevement::recovery {
namespace {

class durable_store_test : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("durable_store_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static std::vector<std::byte> pattern(std::size_t n, std::uint64_t seed) {
    std::vector<std::byte> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = std::byte((i * 131 + seed * 17) & 0xff);
    return v;
  }
  void write(durable_store& s, std::uint64_t id, std::size_t n = 4096) {
    const auto a = pattern(n, id), b = pattern(n / 2, id + 100);
    const std::vector<blob_view> blobs{{"stage-0.bin", a}, {"stage-1.bin", b}};
    s.write_window(id, blobs);
  }
  // Runs `fn` while files over 100 bytes fail to write (EFBIG; the signal ignored meanwhile).
  template <class Fn>
  static void with_small_files(Fn fn) {
    rlimit old{};
    ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
    rlimit small = old;
    small.rlim_cur = 100;
    auto* previous = std::signal(SIGXFSZ, SIG_IGN);
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
    fn();
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
    std::signal(SIGXFSZ, previous);
  }
  std::filesystem::path window_path(std::uint64_t id) const {
    char buf[32];
    std::snprintf(buf, sizeof buf, "window-%020llu", static_cast<unsigned long long>(id));
    return dir_ / buf;
  }
  std::filesystem::path dir_;
};

TEST_F(durable_store_test, round_trip_of_the_latest_window) {
  durable_store s(dir_);
  write(s, 10);
  write(s, 20);
  auto w = s.load_latest();
  ASSERT_TRUE(w.ok()) << w.err().message;
  EXPECT_EQ(w->id, 20u);
  EXPECT_EQ(w->blobs.at("stage-0.bin"), pattern(4096, 20));
  EXPECT_EQ(w->blobs.at("stage-1.bin"), pattern(2048, 120));
}

TEST_F(durable_store_test, corrupt_blob_falls_back_to_previous_window_with_reason) {
  durable_store s(dir_);
  write(s, 10);
  write(s, 20);
  {
    std::fstream f(window_path(20) / "stage-1.bin",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  std::vector<std::string> rejected;
  auto w = s.load_latest(&rejected);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->id, 10u);
  ASSERT_EQ(rejected.size(), 1u);
  EXPECT_NE(rejected[0].find("stage-1.bin: checksum mismatch"), std::string::npos) << rejected[0];
}

TEST_F(durable_store_test, truncated_blob_is_rejected) {
  durable_store s(dir_);
  write(s, 10);
  write(s, 20);
  std::filesystem::resize_file(window_path(20) / "stage-0.bin", 1000);
  std::vector<std::string> rejected;
  auto w = s.load_latest(&rejected);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->id, 10u);
  EXPECT_NE(rejected.at(0).find("truncated"), std::string::npos) << rejected[0];
}

TEST_F(durable_store_test, corrupt_or_foreign_manifest_is_rejected) {
  durable_store s(dir_);
  write(s, 10);
  write(s, 20);
  write(s, 30);
  {  // flip a digit in window 30's manifest body
    const auto p = window_path(30) / "MANIFEST";
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(30);
    f.put('9');
  }
  {  // window 20's manifest replaced by one of another version, with a valid checksum
    std::ofstream f(window_path(20) / "MANIFEST", std::ios::trunc);
    f << "garbage\n";
  }
  std::vector<std::string> rejected;
  auto w = s.load_latest(&rejected);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->id, 10u);
  ASSERT_EQ(rejected.size(), 2u);
  EXPECT_NE(rejected[0].find("window 30: manifest checksum mismatch"), std::string::npos)
      << rejected[0];
  EXPECT_NE(rejected[1].find("window 20:"), std::string::npos) << rejected[1];
}

TEST_F(durable_store_test, nothing_loadable_is_a_clear_error) {
  durable_store s(dir_);
  auto w = s.load_latest();
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.err().message.find("no complete, verified checkpoint window"), std::string::npos);
}

TEST_F(durable_store_test, bad_blob_names_are_refused) {
  durable_store s(dir_);
  const auto bytes = pattern(10, 1);
  for (const char* bad : {"../escape", "a/b", ".hidden", "MANIFEST", ""}) {
    const std::vector<blob_view> blobs{{bad, bytes}};
    EXPECT_THROW(s.write_window(1, blobs), std::invalid_argument) << bad;
  }
  const std::vector<blob_view> dup{{"x", bytes}, {"x", bytes}};
  EXPECT_THROW(s.write_window(1, dup), std::invalid_argument);
}

TEST_F(durable_store_test, manifest_naming_a_path_outside_the_window_is_rejected) {
  durable_store s(dir_);
  write(s, 10);
  // A hand-made manifest with a traversal name and a correct checksum must still fail.
  const std::string body =
      "moevement-durable-window 1\nwindow 11\nblob ../../etc/passwd 1 "
      "0000000000000000\n";
  std::filesystem::create_directories(window_path(11));
  std::ofstream(window_path(11) / "MANIFEST")
      << body << "manifest-xxh64 "
      << hex16(xxhash64(std::as_bytes(std::span(body.data(), body.size())))) << "\n";
  std::vector<std::string> rejected;
  auto w = s.load_latest(&rejected);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->id, 10u);
  EXPECT_NE(rejected.at(0).find("malformed"), std::string::npos) << rejected[0];
}

TEST_F(durable_store_test, writer_killed_mid_window_leaves_previous_window_loadable) {
  {
    durable_store s(dir_);
    write(s, 1);
  }
  for (int attempt = 0; attempt < 4; ++attempt) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      durable_store s(dir_);
      for (std::uint64_t id = 100;; ++id) write(s, id, 16u << 20);
    }
    ::usleep(30000 + attempt * 40000);
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    durable_store s(dir_);
    std::vector<std::string> rejected;
    auto w = s.load_latest(&rejected);
    ASSERT_TRUE(w.ok()) << w.err().message;
    // Whatever window loads is complete and exact.
    const std::size_t n = w->id == 1 ? 4096 : (16u << 20);
    EXPECT_EQ(w->blobs.at("stage-0.bin"), pattern(n, w->id));
    EXPECT_EQ(w->blobs.at("stage-1.bin"), pattern(n / 2, w->id + 100));
    s.prune(2);
    EXPECT_LE(s.windows().size(), 2u);
  }
}

TEST_F(durable_store_test, prune_keeps_the_newest) {
  durable_store s(dir_);
  for (std::uint64_t id : {5, 6, 7, 8}) write(s, id);
  s.prune(2);
  EXPECT_EQ(s.windows(), (std::vector<std::uint64_t>{7, 8}));
}

// A window kept for a rollback past corruption a shadow check finds stays beside the newest.
TEST_F(durable_store_test, prune_keeps_a_window_asked_for_besides) {
  durable_store s(dir_);
  for (std::uint64_t id : {5, 6, 7, 8}) write(s, id);
  s.prune(2, {6});
  EXPECT_EQ(s.windows(), (std::vector<std::uint64_t>{6, 7, 8}));
  s.prune(2);
  EXPECT_EQ(s.windows(), (std::vector<std::uint64_t>{7, 8}));
}

TEST_F(durable_store_test, files_are_private_whatever_the_umask) {
  const mode_t old = ::umask(0);
  {
    durable_store s(dir_ / "nested" / "store");
    write(s, 3);
  }
  ::umask(old);
  auto mode = [](const std::filesystem::path& p) {
    struct stat st {};
    EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
    return st.st_mode & 07777;
  };
  EXPECT_EQ(mode(dir_), 0700u);  // made by the store: every missing parent too
  EXPECT_EQ(mode(dir_ / "nested"), 0700u);
  const auto window = dir_ / "nested" / "store" / window_path(3).filename();
  EXPECT_EQ(mode(window), 0700u);
  for (const auto& e : std::filesystem::directory_iterator(window)) {
    EXPECT_EQ(mode(e.path()), 0600u) << e.path();
  }
}

TEST_F(durable_store_test, a_symlinked_window_is_never_written_or_read_through) {
  // Somebody's directory, linked in under a window's name: writing that window replaces the
  // link and leaves the target alone; the link is never offered as a window.
  const auto outside = dir_.string() + "_outside";
  std::filesystem::remove_all(outside);
  std::filesystem::create_directories(outside);
  { std::ofstream(outside + "/keep.txt") << "not yours"; }
  durable_store s(dir_);
  write(s, 4);
  std::filesystem::create_directory_symlink(outside, window_path(5));
  { std::ofstream(outside + "/MANIFEST") << "moevement-durable-window 1\nwindow 5\n"; }
  EXPECT_EQ(s.windows(), (std::vector<std::uint64_t>{4}));
  write(s, 5);
  EXPECT_FALSE(std::filesystem::is_symlink(window_path(5)));
  EXPECT_EQ(s.windows(), (std::vector<std::uint64_t>{4, 5}));
  EXPECT_TRUE(s.load(5).ok());
  // Pruning, dropping and clearing remove what the store wrote, never the target's files.
  std::filesystem::create_directory_symlink(outside, window_path(2));
  s.prune(1);
  s.drop_after(0);
  s.clear();
  EXPECT_TRUE(std::filesystem::exists(outside + "/keep.txt"));
  EXPECT_TRUE(std::filesystem::exists(outside + "/MANIFEST"));
  std::filesystem::remove_all(outside);
}

TEST_F(durable_store_test, a_failed_write_leaves_no_directory_behind) {
  durable_store s(dir_);
  write(s, 1);
  with_small_files([&] { EXPECT_THROW(write(s, 2), std::runtime_error); });
  EXPECT_FALSE(std::filesystem::exists(window_path(2)));
  EXPECT_EQ(s.windows(), (std::vector<std::uint64_t>{1}));
  EXPECT_TRUE(s.load(1).ok());
}

// A window written again (the same id) that fails halfway leaves the window it had: the new
// one is written beside it and exchanged. (The old manifest used to go first: the window was
// lost to the failed rewrite.)
TEST_F(durable_store_test, a_failed_rewrite_leaves_the_window_it_had) {
  durable_store s(dir_);
  write(s, 1);
  write(s, 2);
  with_small_files([&] { EXPECT_THROW(write(s, 2, 8192), std::runtime_error); });
  EXPECT_EQ(s.windows(), (std::vector<std::uint64_t>{1, 2}));
  auto w = s.load_latest();
  ASSERT_TRUE(w.ok()) << w.err().message;
  EXPECT_EQ(w->id, 2u);
  EXPECT_EQ(w->blobs.at("stage-0.bin"), pattern(4096, 2)) << "not the window it had";
  // A rewrite that succeeds replaces it, and leaves nothing beside it.
  write(s, 2, 8192);
  w = s.load(2);
  ASSERT_TRUE(w.ok()) << w.err().message;
  EXPECT_EQ(w->blobs.at("stage-0.bin"), pattern(8192, 2));
  std::size_t entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_)) {
    (void)e;
    ++entries;
  }
  EXPECT_EQ(entries, 2u) << "the old window or a staging directory was left behind";
}

// On a file system without RENAME_EXCHANGE a rewrite renames twice; killed between the two, it
// leaves the old window and the new one beside an empty name. The next prune puts the new one
// back, and removes the old.
TEST_F(durable_store_test, a_rewrite_killed_between_its_renames_is_put_back_by_the_next_prune) {
  durable_store s(dir_);
  write(s, 1);
  write(s, 2);
  const auto old_copy = dir_ / "window-00000000000000000002.old";
  std::filesystem::copy(window_path(2), old_copy);
  write(s, 2, 8192);
  std::filesystem::rename(window_path(2), dir_ / "window-00000000000000000002.new");
  EXPECT_EQ(s.windows(), (std::vector<std::uint64_t>{1}));
  s.prune(5);
  EXPECT_EQ(s.windows(), (std::vector<std::uint64_t>{1, 2}));
  auto w = s.load(2);
  ASSERT_TRUE(w.ok()) << w.err().message;
  EXPECT_EQ(w->blobs.at("stage-0.bin"), pattern(8192, 2)) << "the old window was put back";
  EXPECT_FALSE(std::filesystem::exists(old_copy));
}

// A store directory that exists but cannot be listed is an error naming it, never "no
// windows" (a requeued job then started over and cleared them).
TEST_F(durable_store_test, a_directory_that_cannot_be_listed_is_an_error_not_empty) {
  durable_store s(dir_);
  write(s, 1);
  std::filesystem::remove_all(dir_);
  { std::ofstream(dir_) << "not a directory"; }  // (chmod cannot stop root, who runs CI)
  try {
    (void)s.windows();
    ADD_FAILURE() << "listed a file as an empty store";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir_.string()), std::string::npos) << e.what();
  }
  s.prune(1);  // a prune that cannot list removes nothing, and does not throw
  std::filesystem::remove(dir_);
  EXPECT_TRUE(s.windows().empty()) << "a store directory that does not exist holds none";
}

}  // namespace
}  // namespace moevement::recovery
