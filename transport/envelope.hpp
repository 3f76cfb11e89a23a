// Encoding and validated decoding of the wire envelope (transport/envelope.capnp).
// Everything from the wire is untrusted: decode() checks the segment table, the traversal
// and nesting limits and the whole pointer graph before anyone reads a field.
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "base/result.hpp"
#include "transport/envelope.capnp.h"

namespace moevement::transport {

struct actor_address {
  std::uint32_t node = 0;
  std::uint32_t incarnation = 0;
  std::uint64_t actor = 0;
  bool operator==(const actor_address&) const = default;
};

struct envelope_header {
  actor_address sender;
  actor_address receiver;
  std::uint64_t type_id = 0;
  std::uint64_t correlation_id = 0;
  std::uint64_t budget_ns = 0;
  bool operator==(const envelope_header&) const = default;
};

// Limits applied to every decoded envelope. Defaults live here and only here.
struct decode_limits {
  std::size_t max_bytes = 16u << 20;                // whole message; tensors go out of band
  std::uint64_t traversal_words = (16u << 20) / 8;  // words readable in total
  int nesting = 16;                                 // pointer depth
};

// Builds one envelope. The payload is any Cap'n Proto struct.
class outgoing_envelope {
 public:
  explicit outgoing_envelope(const envelope_header& header);

  // Also stamps the envelope's type id with the payload's schema id.
  template <class Payload>
  typename Payload::Builder init_payload() {
    root_.setTypeId(capnp::typeId<Payload>());
    return root_.getPayload().template initAs<Payload>();
  }

  // The flat serialized form (segment table + segments), 8-byte aligned.
  kj::Array<capnp::word> to_words();

 private:
  capnp::MallocMessageBuilder message_;
  wire::Envelope::Builder root_;
};

// A validated envelope read in place from a buffer the caller keeps alive (copied only
// when the buffer is not 8-byte aligned).
class incoming_envelope {
 public:
  static result<incoming_envelope> decode(std::span<const std::byte> bytes,
                                          const decode_limits& limits = {});

  const envelope_header& header() const { return header_; }

  // The payload as the struct the type id names; an error if the sender said another type
  // or sent something that is not a struct. Nested pointer fields are still read lazily and
  // a handler's reads can throw kj::Exception, which the dispatch boundary catches.
  template <class Payload>
  result<typename Payload::Reader> payload() const {
    if (header_.type_id != capnp::typeId<Payload>()) {
      return error{"envelope type id does not match the requested payload type"};
    }
    auto any = reader_->getRoot<wire::Envelope>().getPayload();
    const auto kind = any.getPointerType();
    if (kind != capnp::PointerType::STRUCT && kind != capnp::PointerType::NULL_) {
      return error{"envelope payload is not a struct"};
    }
    return any.template getAs<Payload>();
  }
  bool copied() const { return aligned_copy_.size() != 0; }
  // Keeps the buffer the envelope reads in place alive as long as the envelope: links hand
  // envelopes to handlers, which may keep them past the receive.
  void hold(std::shared_ptr<const void> buffer) { buffer_ = std::move(buffer); }

 private:
  incoming_envelope() = default;
  std::shared_ptr<const void> buffer_;   // declared first: destroyed after the reader
  kj::Array<capnp::word> aligned_copy_;  // (capnp::word is not copyable: no std::vector)
  std::unique_ptr<capnp::FlatArrayMessageReader> reader_;
  envelope_header header_;
};

}  // namespace moevement::transport
