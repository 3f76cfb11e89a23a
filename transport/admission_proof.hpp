// Proof that the far end of an admission holds the job token, without either end sending it:
// each end answers the other's fresh nonce with an HMAC-SHA256 keyed by the token, over every
// byte of the exchange so far. A process that merely listens at a peer's old address (a freed
// port taken by another user) learns nothing it can use, and no byte of the exchange can be
// changed, or replayed into another exchange, without the proof failing.
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <string_view>

namespace moevement::transport::detail {

constexpr std::size_t nonce_bytes = 32;
constexpr std::size_t proof_bytes = 32;  // SHA-256
using nonce = std::array<std::byte, nonce_bytes>;
using proof = std::array<std::byte, proof_bytes>;

// A nonce from the system's random source. Throws where there is none.
nonce fresh_nonce();
// HMAC-SHA256(token, label || transcript). `label` says which end proves (the dialler's proof
// can never stand for the acceptor's).
proof prove(std::string_view token, std::string_view label, std::span<const std::byte> transcript);
// Compares in constant time (a timing difference would leak how much of a forgery was right).
bool same_proof(std::span<const std::byte> a, const proof& b);

}  // namespace moevement::transport::detail
