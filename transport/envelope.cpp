#include "transport/envelope.hpp"

#include <fmt/format.h>
#include <kj/exception.h>

#include <cstring>

namespace moevement::transport {
namespace {

void set_address(wire::ActorAddress::Builder b, const actor_address& a) {
  b.setNode(a.node);
  b.setIncarnation(a.incarnation);
  b.setActor(a.actor);
}

actor_address get_address(wire::ActorAddress::Reader r) {
  return {r.getNode(), r.getIncarnation(), r.getActor()};
}

}  // namespace

outgoing_envelope::outgoing_envelope(const envelope_header& h)
    : root_(message_.initRoot<wire::Envelope>()) {
  set_address(root_.initSender(), h.sender);
  set_address(root_.initReceiver(), h.receiver);
  root_.setTypeId(h.type_id);
  root_.setCorrelationId(h.correlation_id);
  root_.setBudgetNs(h.budget_ns);
}

kj::Array<capnp::word> outgoing_envelope::to_words() {
  return capnp::messageToFlatArray(message_);
}

result<incoming_envelope> incoming_envelope::decode(std::span<const std::byte> bytes,
                                                    const decode_limits& limits) {
  if (bytes.size() > limits.max_bytes) {
    return error{fmt::format("envelope of {} bytes exceeds the limit of {} bytes", bytes.size(),
                             limits.max_bytes)};
  }
  if (bytes.size() < sizeof(capnp::word) || bytes.size() % sizeof(capnp::word) != 0) {
    return error{
        fmt::format("envelope of {} bytes is not a whole number of 8-byte words", bytes.size())};
  }
  incoming_envelope env;
  const capnp::word* words = reinterpret_cast<const capnp::word*>(bytes.data());
  const std::size_t n_words = bytes.size() / sizeof(capnp::word);
  if (reinterpret_cast<std::uintptr_t>(bytes.data()) % alignof(capnp::word) != 0) {
    env.aligned_copy_ = kj::heapArray<capnp::word>(n_words);
    std::memcpy(static_cast<void*>(env.aligned_copy_.begin()), bytes.data(), bytes.size());
    words = env.aligned_copy_.begin();
  }
  capnp::ReaderOptions options;
  options.traversalLimitInWords = limits.traversal_words;
  options.nestingLimit = limits.nesting;
  try {
    env.reader_ = std::make_unique<capnp::FlatArrayMessageReader>(
        kj::ArrayPtr<const capnp::word>(words, n_words), options);
    // Reading is lazy in Cap'n Proto; walk the whole graph now so that a malformed pointer
    // anywhere (payload included) is found here, not in a handler.
    auto root = env.reader_->getRoot<wire::Envelope>();
    (void)root.totalSize();
    env.header_.sender = get_address(root.getSender());
    env.header_.receiver = get_address(root.getReceiver());
    env.header_.type_id = root.getTypeId();
    env.header_.correlation_id = root.getCorrelationId();
    env.header_.budget_ns = root.getBudgetNs();
    // totalSize() consumed traversal budget; give the handler a fresh allowance by
    // re-creating the reader over the same (now known good) words.
    env.reader_ = std::make_unique<capnp::FlatArrayMessageReader>(
        kj::ArrayPtr<const capnp::word>(words, n_words), options);
  } catch (const kj::Exception& e) {
    return error{fmt::format("malformed envelope: {}", e.getDescription().cStr())};
  }
  return env;
}

}  // namespace moevement::transport
