#include "transport/admission_proof.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <stdexcept>
#include <vector>

namespace moevement::transport::detail {

nonce fresh_nonce() {
  nonce n{};
  if (RAND_bytes(reinterpret_cast<unsigned char*>(n.data()), static_cast<int>(n.size())) != 1) {
    throw std::runtime_error(
        "no random bytes for an admission nonce (the system's random source failed)");
  }
  return n;
}

proof prove(std::string_view token, std::string_view label, std::span<const std::byte> transcript) {
  std::vector<unsigned char> message(label.begin(), label.end());
  message.push_back(0);  // the label ends here, whatever the transcript starts with
  const auto* t = reinterpret_cast<const unsigned char*>(transcript.data());
  message.insert(message.end(), t, t + transcript.size());
  proof p{};
  unsigned int length = 0;
  if (HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), message.data(),
           message.size(), reinterpret_cast<unsigned char*>(p.data()), &length) == nullptr ||
      length != p.size()) {
    throw std::runtime_error("HMAC-SHA256 failed (the crypto library is broken)");
  }
  return p;
}

bool same_proof(std::span<const std::byte> a, const proof& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), b.size()) == 0;
}

}  // namespace moevement::transport::detail
