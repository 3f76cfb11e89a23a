// Shared by the multi-process link tests and their helper process (link_peer).
#pragma once

#include <capnp/message.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tests/transport/link_test.capnp.h"
#include "transport/bulk.hpp"
#include "transport/envelope.hpp"
#include "transport/link.hpp"

namespace moevement::transport::testing {

// Fills bytes with a pattern that depends on every index (splitmix64 of the word index).
inline void fill_pattern(std::span<std::byte> bytes, std::uint64_t seed) {
  std::uint64_t* w = reinterpret_cast<std::uint64_t*>(bytes.data());
  const std::size_t n = bytes.size() / 8;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    w[i] = z ^ (z >> 31);
  }
  for (std::size_t i = n * 8; i < bytes.size(); ++i) bytes[i] = std::byte(i * 131 + seed);
}

struct test_message {
  std::string kind;
  std::uint64_t seq = 0;
  std::vector<std::byte> blob;
  bulk_descriptor descriptor;
  std::uint64_t checksum = 0;
  std::vector<std::uint64_t> counts;
};

inline test_message make(std::string kind, std::uint64_t seq = 0,
                         std::vector<std::byte> blob = {}) {
  test_message m;
  m.kind = std::move(kind);
  m.seq = seq;
  m.blob = std::move(blob);
  return m;
}

inline kj::Array<capnp::word> encode(node_id from, node_id to, const test_message& m) {
  outgoing_envelope out({{from, 1, 1}, {to, 1, 1}, 0, m.seq, 0});
  auto p = out.init_payload<wire::test::TestMessage>();
  p.setKind(m.kind);
  p.setSeq(m.seq);
  if (!m.blob.empty()) {
    p.setBlob(kj::arrayPtr(reinterpret_cast<const capnp::byte*>(m.blob.data()), m.blob.size()));
  }
  write_descriptor(p.initDescriptor(), m.descriptor);
  p.setChecksum(m.checksum);
  auto c = p.initCounts(static_cast<unsigned>(m.counts.size()));
  for (unsigned i = 0; i < m.counts.size(); ++i) c.set(i, m.counts[i]);
  return out.to_words();
}

inline test_message decode(const incoming_envelope& env) {
  auto p = env.payload<wire::test::TestMessage>().value();
  test_message m;
  m.kind = p.getKind();
  m.seq = p.getSeq();
  auto b = p.getBlob();
  m.blob.assign(reinterpret_cast<const std::byte*>(b.begin()),
                reinterpret_cast<const std::byte*>(b.end()));
  auto d = p.getDescriptor();
  m.descriptor = {d.getNode(), d.getRegion(), d.getOffset(), d.getLength()};
  m.checksum = p.getChecksum();
  for (auto c : p.getCounts()) m.counts.push_back(c);
  return m;
}

}  // namespace moevement::transport::testing
