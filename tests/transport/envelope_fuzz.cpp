// libFuzzer target for the envelope decoder: any bytes in, a result out, never a crash, a
// leak or undefined behaviour. Decoded envelopes are read further the way a handler would:
// the header, then the payload as a bulk descriptor (the untrusted struct the transport
// itself interprets). Built with clang (-fsanitize=fuzzer,address,undefined) where found.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "transport/bulk.hpp"
#include "transport/envelope.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace moevement::transport;
  // Receive buffers are 8-byte aligned; test the aligned case and the copying one.
  std::vector<capnp::word> aligned((size + 7) / 8);
  if (size != 0) std::memcpy(static_cast<void*>(aligned.data()), data, size);
  const auto bytes = std::as_bytes(std::span(aligned)).first(size);
  for (auto input : {bytes, std::span(reinterpret_cast<const std::byte*>(data), size)}) {
    auto env = incoming_envelope::decode(input);
    if (!env.ok()) continue;
    (void)env->header();
    auto d = env->payload<moevement::wire::BulkDescriptor>();
    if (d.ok()) (void)read_descriptor(*d);
  }
  return 0;
}
