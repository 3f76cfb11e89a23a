// Same-host shared memory: a second process maps what the first wrote, keeps it after the
// first is killed, and refuses handles that name anything else.
#include "transport/shared_memory.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <capnp/message.h>

namespace moevement::transport {
namespace {

TEST(shared_memory, a_handle_maps_the_same_pages) {
  auto owner = shared_memory::create(1 << 20);
  std::memset(owner.memory().data(), 0x5a, owner.memory().size());
  auto view = shared_memory::open(owner.share(4096, 8192));
  ASSERT_TRUE(view.ok()) << view.err().message;
  ASSERT_EQ(view->memory().size(), owner.memory().size());
  EXPECT_EQ(view->memory()[4096], std::byte{0x5a});
  owner.memory()[5000] = std::byte{7};  // the same pages, not a copy
  EXPECT_EQ(view->memory()[5000], std::byte{7});
  // and a view can be shared on (a replica answering a replacement)
  auto again = shared_memory::open(view->share(0, 16));
  ASSERT_TRUE(again.ok()) << again.err().message;
  EXPECT_EQ(again->memory()[5000], std::byte{7});
}

TEST(shared_memory, a_memory_file_is_the_owners_only) {
  auto owner = shared_memory::create(4096);
  const auto h = owner.share(0, 16);
  struct stat st {};
  ASSERT_EQ(::fstat(h.fd, &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST(shared_memory, the_pages_outlive_a_killed_owner) {
  int to_parent[2], to_child[2];
  ASSERT_EQ(::pipe(to_parent), 0);
  ASSERT_EQ(::pipe(to_child), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto m = shared_memory::create(3 << 20);
    for (std::size_t i = 0; i < m.memory().size(); ++i) m.memory()[i] = std::byte(i * 31);
    const share_handle h = m.share(0, m.memory().size());
    (void)!::write(to_parent[1], &h, sizeof h);
    char c;
    (void)!::read(to_child[0], &c, 1);  // wait to be killed
    ::_exit(0);
  }
  share_handle h;
  ASSERT_EQ(::read(to_parent[0], &h, sizeof h), ssize_t(sizeof h));
  auto view = shared_memory::open(h);
  ASSERT_TRUE(view.ok()) << view.err().message;
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  for (std::size_t i = 0; i < view->memory().size(); i += 4093) {
    ASSERT_EQ(view->memory()[i], std::byte(i * 31)) << i;
  }
  // The owner is gone: its handle opens nothing any more.
  EXPECT_FALSE(shared_memory::open(h).ok());
  for (int fd : {to_parent[0], to_parent[1], to_child[0], to_child[1]}) ::close(fd);
}

TEST(shared_memory, a_handle_naming_anything_else_is_refused) {
  auto owner = shared_memory::create(65536);
  const share_handle good = owner.share(0, 65536);
  auto wrong_inode = good;
  wrong_inode.inode += 1;
  EXPECT_FALSE(shared_memory::open(wrong_inode).ok());
  auto wrong_size = good;
  wrong_size.size *= 2;
  wrong_size.length = 1;
  EXPECT_FALSE(shared_memory::open(wrong_size).ok());
  auto outside = good;
  outside.offset = 65536;
  outside.length = 1;
  EXPECT_FALSE(shared_memory::open(outside).ok());
  auto wraps = good;
  wraps.offset = ~std::uint64_t(0);
  wraps.length = 2;
  EXPECT_FALSE(shared_memory::open(wraps).ok());
  auto no_fd = good;
  no_fd.fd = 100000;
  EXPECT_FALSE(shared_memory::open(no_fd).ok());
  // Another host's handle (its pid and descriptor would name some process here) is refused
  // before anything of this host is opened: the replica pulls instead.
  auto elsewhere = good;
  elsewhere.host ^= 1;
  auto r_elsewhere = shared_memory::open(elsewhere);
  ASSERT_FALSE(r_elsewhere.ok());
  EXPECT_NE(r_elsewhere.err().message.find("another host"), std::string::npos);
  EXPECT_EQ(good.host, host_tag()) << "a handle names its owner's host";
  EXPECT_TRUE(shared_memory::open(good).ok());
  // A file on disk, even with its true identity, is never mapped.
  const auto path = std::filesystem::temp_directory_path() / "moevement_shared_memory_test";
  std::ofstream(path) << std::string(4096, 'x');
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  const share_handle disk{std::int32_t(::getpid()),
                          fd,
                          std::uint64_t(st.st_dev),
                          std::uint64_t(st.st_ino),
                          4096,
                          0,
                          4096,
                          host_tag()};
  auto r = shared_memory::open(disk);
  EXPECT_FALSE(r.ok());
  if (!r.ok()) {
    EXPECT_NE(r.err().message.find("not shared memory"), std::string::npos);
  }
  ::close(fd);
  std::filesystem::remove(path);
}

TEST(shared_memory, handles_from_the_wire_are_checked) {
  capnp::MallocMessageBuilder msg;
  auto b = msg.initRoot<wire::ShareHandle>();
  write_share(b, share_handle{42, 3, 1, 2, 100, 10, 20, 77});
  auto r = read_share(b.asReader());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, (share_handle{42, 3, 1, 2, 100, 10, 20, 77}));
  b.setOffset(90);  // 90 + 20 > 100
  EXPECT_FALSE(read_share(b.asReader()).ok());
  b.setOffset(0);
  b.setLength(0);
  EXPECT_FALSE(read_share(b.asReader()).ok());
  b.setLength(1);
  b.setPid(0);
  EXPECT_FALSE(read_share(b.asReader()).ok());
}

}  // namespace
}  // namespace moevement::transport
