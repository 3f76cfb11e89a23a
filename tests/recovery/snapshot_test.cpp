// Snapshot slots: the bytes hold exactly the live state (full entries restore it bit for bit,
// compute entries carry the compute weights), and corrupt or truncated bytes are rejected with
// a clear error, never a crash.
#include "recovery/snapshot.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>

#include <sys/mman.h>

#include "base/hash.hpp"
#include "engine/local_pipeline.hpp"
#include "engine/stage_model.hpp"
#include "models/cuda/device.hpp"
#include "tests/support/small_train.hpp"

namespace moevement::recovery {
namespace {

using test_support::test_train;

struct slot_fixture : testing::Test {
  engine::local_pipeline pipe{models::preset("tiny"), test_train(), 2};
  std::vector<models::operator_state*> ops;
  std::vector<const models::operator_state*> cops;
  std::vector<capture_kind> kinds;
  std::vector<std::byte> bytes;
  void SetUp() override {
    pipe.train_iteration();  // non-trivial m, v and step
    ops = pipe.stage(1, 0).operators();
    cops.assign(ops.begin(), ops.end());
    for (std::size_t i = 0; i < ops.size(); ++i) {
      kinds.push_back(i % 3 == 0 ? capture_kind::full
                                 : (i % 3 == 1 ? capture_kind::compute : capture_kind::skip));
    }
    bytes.resize(snapshot_size(cops, kinds));
    write_snapshot(bytes, {7, 2, 9, 1, 0}, pipe.scaler(), cops, kinds);
  }
};

TEST_F(slot_fixture, bytes_hold_the_live_state) {
  const auto v = parse_snapshot(bytes);
  EXPECT_EQ(v.tag, (snapshot_tag{7, 2, 9, 1, 0}));
  EXPECT_EQ(v.scaler.scale, pipe.scaler().scale);
  EXPECT_EQ(v.bytes, bytes.size());
  std::size_t k = 0;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (kinds[i] == capture_kind::skip) continue;
    ASSERT_LT(k, v.entries.size());
    const auto& e = v.entries[k++];
    EXPECT_EQ(e.index, i);
    EXPECT_EQ(e.name, ops[i]->name());
    if (kinds[i] == capture_kind::full) {
      EXPECT_EQ(e.step, ops[i]->step());
      EXPECT_EQ(std::memcmp(e.master.data(), ops[i]->master().data(), e.master.size()), 0);
      EXPECT_EQ(std::memcmp(e.adam_v.data(), ops[i]->adam_v().data(), e.adam_v.size()), 0);
    } else {
      ASSERT_EQ(e.compute.size(), ops[i]->compute_bytes().size());
      EXPECT_EQ(std::memcmp(e.compute.data(), ops[i]->compute_bytes().data(), e.compute.size()), 0);
    }
  }
  EXPECT_EQ(k, v.entries.size());
  // loading into a fresh stage reproduces the full operators' digests
  engine::local_pipeline fresh{models::preset("tiny"), test_train(), 2};
  auto fops = fresh.stage(1, 0).operators();
  for (const auto& e : v.entries) load_operator(e, *fops[e.index]);
  for (const auto& e : v.entries) {
    if (e.mode == models::op_mode::active) {
      EXPECT_EQ(fops[e.index]->digest(), ops[e.index]->digest()) << e.name;
    } else {
      EXPECT_EQ(fops[e.index]->mode(), models::op_mode::frozen);
      EXPECT_TRUE(
          std::ranges::equal(fops[e.index]->compute_bytes(), ops[e.index]->compute_bytes()));
      fops[e.index]->set_mode(models::op_mode::active);
    }
  }
  // an entry of another operator does not load
  EXPECT_THROW(load_operator(v.entries[0], *fops[1]), snapshot_error);
}

// The writer hashes block by block as it copies; the checksum must still be XXH3-64 of the
// whole body, over a slot of many blocks.
TEST_F(slot_fixture, the_checksum_is_xxh3_of_the_whole_body) {
  const std::vector<capture_kind> all_full(cops.size(), capture_kind::full);
  std::vector<std::byte> big(snapshot_size(cops, all_full));
  ASSERT_GT(big.size(), std::size_t(2) << 18) << "the stage must span several hash blocks";
  write_snapshot(big, {1, 0, 1, 1, 0}, pipe.scaler(), cops, all_full);
  std::uint64_t stored = 0;
  std::memcpy(&stored, big.data() + big.size() - sizeof stored, sizeof stored);
  EXPECT_EQ(stored, xxh3_64(std::span<const std::byte>(big).first(big.size() - sizeof stored)));
  EXPECT_NO_THROW((void)parse_snapshot(big));
}

// A slot of format 1 (XXH64 checksum) is refused for its version, not taken for corrupt.
TEST_F(slot_fixture, a_slot_of_another_format_version_says_so) {
  auto old = bytes;
  const std::uint32_t v1 = 1;
  std::memcpy(old.data() + 8, &v1, sizeof v1);
  const std::uint64_t sum =
      xxhash64(std::span<const std::byte>(old).first(old.size() - sizeof sum));
  std::memcpy(old.data() + old.size() - sizeof sum, &sum, sizeof sum);
  try {
    (void)parse_snapshot(old);
    FAIL() << "a format-1 slot parsed";
  } catch (const snapshot_error& e) {
    EXPECT_NE(std::string(e.what()).find("format version 1, expected 2"), std::string::npos)
        << e.what();
  }
}

TEST_F(slot_fixture, every_truncation_and_every_flipped_byte_is_rejected) {
  for (std::size_t n = 0; n < bytes.size(); n += 1 + n / 8) {
    EXPECT_THROW(parse_snapshot(std::span(bytes).first(n)), snapshot_error) << n << " bytes";
  }
  for (std::size_t at = 0; at < bytes.size(); at += 1 + at / 16) {
    auto bad = bytes;
    bad[at] ^= std::byte{0x01};
    EXPECT_THROW(parse_snapshot(bad), snapshot_error) << "byte " << at;
  }
  auto longer = bytes;
  longer.push_back(std::byte{0});
  EXPECT_THROW(parse_snapshot(longer), snapshot_error);
}

// The tag alone (what a replica checks after a pull): read without the checksum, refused when
// the bytes do not start like a slot.
TEST_F(slot_fixture, the_tag_reads_alone) {
  EXPECT_EQ(read_snapshot_tag(bytes), (snapshot_tag{7, 2, 9, 1, 0}));
  auto other = bytes;
  other[other.size() / 2] ^= std::byte{1};  // the body: the tag still reads (no checksum)
  EXPECT_EQ(read_snapshot_tag(other), (snapshot_tag{7, 2, 9, 1, 0}));
  other = bytes;
  other[0] ^= std::byte{1};  // magic
  EXPECT_FALSE(read_snapshot_tag(other).has_value());
  other = bytes;
  other[8] ^= std::byte{1};  // format version
  EXPECT_FALSE(read_snapshot_tag(other).has_value());
  EXPECT_FALSE(read_snapshot_tag(std::span<const std::byte>(bytes).first(20)).has_value());
  EXPECT_FALSE(read_snapshot_tag({}).has_value());
}

TEST_F(slot_fixture, a_buffer_of_the_wrong_size_is_refused) {
  std::vector<std::byte> small(bytes.size() - 1);
  EXPECT_THROW(write_snapshot(small, {}, pipe.scaler(), cops, kinds), std::invalid_argument);
  kinds.pop_back();
  EXPECT_THROW(snapshot_size(cops, kinds), std::invalid_argument);
}

// A GPU stage's slot, copied from device memory on the side stream, holds the bytes the host
// writes from the synced operators: into page-locked memory (the DMA path) and pageable memory.
TEST(device_slot, equals_the_host_slot_of_the_same_state) {
  if (models::cuda::device_count() == 0) {
    GTEST_SKIP() << "no usable GPU: " << models::cuda::describe_device();
  }
  engine::stage_setup s;
  s.model = models::preset("tiny");
  s.train = test_train();
  s.train.device = models::device::cuda;
  s.train.data_parallel = 1;
  const auto st = engine::make_moe_stage(s);
  engine::device_state* dev = st->device();
  ASSERT_NE(dev, nullptr);
  const auto ops = st->operators();
  const std::vector<const models::operator_state*> cops(ops.begin(), ops.end());
  std::vector<capture_kind> kinds;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    kinds.push_back(i % 3 == 0 ? capture_kind::full
                               : (i % 3 == 1 ? capture_kind::compute : capture_kind::skip));
  }
  const std::size_t n = snapshot_size(cops, kinds);
  std::vector<std::byte> pageable(n);
  // Nothing stepped on the device yet: it holds no state to copy, and says so.
  EXPECT_THROW(write_snapshot(pageable, {1, 0, 1, 0, 0}, {}, cops, kinds, *dev), std::logic_error);
  models::loss_scaler scaler;
  for (std::int64_t it = 0; it < 2; ++it) {
    engine::begin_operators(ops);
    st->begin_iteration(it);
    for (int mb = 0; mb < s.train.micro_batches; ++mb) {
      st->forward(mb, {});
      st->backward(mb, {}, 1.0f / float(s.train.micro_batches));
    }
    const auto sums = dev->grads_on_device() ? dev->grad_sq_sums() : engine::gradient_sq_sums(ops);
    const auto plan = models::plan_step(sums, scaler, s.train.grad_clip);
    dev->step(plan, s.train, false);
  }
  const auto pinned = dev->alloc_pinned(n);
  const std::span<std::byte> locked(pinned.get(), n);
  // An mmap'd region page-locked in place (as the slot pool's memory files are). Locking it
  // twice fails; the failure must not linger as a CUDA error that fails the next copy.
  void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  const std::unique_ptr<void, std::function<void(void*)>> unmap(m,
                                                                [n](void* p) { ::munmap(p, n); });
  const std::span<std::byte> mapped(static_cast<std::byte*>(m), n);
  {
    const auto lock = dev->pin(mapped);
    EXPECT_THROW(dev->pin(mapped), std::runtime_error);
    const snapshot_tag tag{3, 1, 2, 0, 0};
    write_snapshot(mapped, tag, scaler, cops, kinds, *dev);  // compute entries: a kernel too
  }
  const snapshot_tag tag{3, 1, 2, 0, 0};
  write_snapshot(locked, tag, scaler, cops, kinds, *dev);
  write_snapshot(pageable, tag, scaler, cops, kinds, *dev);
  dev->sync_to_host();
  std::vector<std::byte> host(n);
  write_snapshot(host, tag, scaler, cops, kinds);
  EXPECT_EQ(0, std::memcmp(locked.data(), host.data(), n));
  EXPECT_EQ(0, std::memcmp(mapped.data(), host.data(), n));
  EXPECT_EQ(pageable, host);
  const auto v = parse_snapshot(locked);
  EXPECT_EQ(v.tag, tag);
  EXPECT_EQ(v.entries.front().step, 2);  // the device's steps are counted on the host
}

}  // namespace
}  // namespace moevement::recovery
