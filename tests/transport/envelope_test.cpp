#include "transport/envelope.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

namespace moevement::transport {
namespace {

envelope_header sample_header() {
  return {{1, 7, 42}, {2, 3, 99}, capnp::typeId<wire::ActorAddress>(), 77, 5'000'000};
}

std::vector<std::byte> encode_sample() {
  outgoing_envelope out(sample_header());
  auto payload = out.init_payload<wire::ActorAddress>();
  payload.setNode(11);
  payload.setActor(0xfeedull);
  auto words = out.to_words();
  auto bytes = std::as_bytes(std::span(words.begin(), words.size()));
  return {bytes.begin(), bytes.end()};
}

// Keeps bytes 8-byte aligned, as the transport's receive buffers are.
std::vector<capnp::word> aligned(const std::vector<std::byte>& b) {
  std::vector<capnp::word> w((b.size() + 7) / 8);
  std::memcpy(static_cast<void*>(w.data()), b.data(), b.size());
  return w;
}

TEST(envelope, round_trip_reads_in_place) {
  const auto bytes = encode_sample();
  const auto words = aligned(bytes);
  auto in = incoming_envelope::decode(std::as_bytes(std::span(words)).first(bytes.size()));
  ASSERT_TRUE(in.ok()) << in.err().message;
  EXPECT_EQ(in->header(), sample_header());
  EXPECT_FALSE(in->copied());
  auto p = in->payload<wire::ActorAddress>();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->getNode(), 11u);
  EXPECT_EQ(p->getActor(), 0xfeedull);
}

TEST(envelope, payload_of_another_type_is_an_error) {
  const auto bytes = encode_sample();
  const auto words = aligned(bytes);
  auto in = incoming_envelope::decode(std::as_bytes(std::span(words)).first(bytes.size()));
  ASSERT_TRUE(in.ok());
  EXPECT_FALSE(in->payload<wire::Envelope>().ok());
}

TEST(envelope, unaligned_buffer_is_copied_then_read) {
  const auto bytes = encode_sample();
  std::vector<std::byte> shifted(bytes.size() + 1);
  std::memcpy(shifted.data() + 1, bytes.data(), bytes.size());
  auto in = incoming_envelope::decode(std::span(shifted).subspan(1));
  ASSERT_TRUE(in.ok()) << in.err().message;
  EXPECT_TRUE(in->copied());
  EXPECT_EQ(in->header(), sample_header());
}

TEST(envelope, every_truncation_is_rejected_not_crashed) {
  const auto bytes = encode_sample();
  const auto words = aligned(bytes);
  const auto all = std::as_bytes(std::span(words)).first(bytes.size());
  for (std::size_t len = 0; len < all.size(); ++len) {
    auto in = incoming_envelope::decode(all.first(len));
    EXPECT_FALSE(in.ok()) << "accepted a truncation to " << len << " bytes";
  }
}

TEST(envelope, oversized_message_rejected_before_parsing) {
  std::vector<capnp::word> big(1024);
  decode_limits limits;
  limits.max_bytes = 1024;
  auto in = incoming_envelope::decode(std::as_bytes(std::span(big)), limits);
  ASSERT_FALSE(in.ok());
  EXPECT_NE(in.err().message.find("exceeds the limit"), std::string::npos);
}

TEST(envelope, huge_segment_count_rejected) {
  std::vector<capnp::word> w(4);
  const std::uint32_t segments_minus_one = 0xfffffff0u;
  std::memcpy(static_cast<void*>(w.data()), &segments_minus_one, 4);
  auto in = incoming_envelope::decode(std::as_bytes(std::span(w)));
  EXPECT_FALSE(in.ok());
}

TEST(envelope, traversal_limit_enforced) {
  // A payload of 64 KiB of data, read with a traversal limit of 1 KiB.
  outgoing_envelope out(sample_header());
  capnp::MallocMessageBuilder scratch;
  auto words = [&] {
    auto p = out.init_payload<wire::Envelope>();
    p.getPayload().initAs<capnp::Data>(64 * 1024);
    return out.to_words();
  }();
  decode_limits limits;
  limits.traversal_words = 128;
  auto in =
      incoming_envelope::decode(std::as_bytes(std::span(words.begin(), words.size())), limits);
  EXPECT_FALSE(in.ok());
}

TEST(envelope, nesting_limit_enforced) {
  // Envelope inside envelope inside ... 40 deep, read with a nesting limit of 16.
  outgoing_envelope out(sample_header());
  auto p = out.init_payload<wire::Envelope>();
  for (int i = 0; i < 40; ++i) p = p.getPayload().initAs<wire::Envelope>();
  auto words = out.to_words();
  auto in = incoming_envelope::decode(std::as_bytes(std::span(words.begin(), words.size())));
  EXPECT_FALSE(in.ok());
}

TEST(envelope, random_and_mutated_inputs_never_crash) {
  std::mt19937_64 rng(2026);
  const auto good = encode_sample();
  int accepted = 0;
  for (int round = 0; round < 20000; ++round) {
    std::vector<capnp::word> w;
    std::size_t len;
    if (round % 2 == 0) {  // pure noise
      len = 8 * (1 + rng() % 32);
      w.resize(len / 8);
      for (auto& x : w) {
        const std::uint64_t r = rng();
        std::memcpy(static_cast<void*>(&x), &r, 8);
      }
    } else {  // a valid message with a few bytes flipped
      w = aligned(good);
      len = good.size();
      auto* b = reinterpret_cast<unsigned char*>(w.data());
      for (int f = 0; f < 3; ++f) b[rng() % len] ^= static_cast<unsigned char>(1 + rng() % 255);
    }
    auto in = incoming_envelope::decode(std::as_bytes(std::span(w)).first(len));
    if (in.ok()) {
      ++accepted;
      auto p = in->payload<wire::ActorAddress>();
      if (p.ok()) (void)p->getActor();  // primitives of a validated struct never throw
    }
  }
  SUCCEED() << accepted << " mutated inputs happened to be valid";
}

}  // namespace
}  // namespace moevement::transport
