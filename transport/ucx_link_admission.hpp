// Admission: who may open a connection to a link, decided on a TCP socket of the link's own
// before any UCX endpoint exists.
//
// Four frames, each end proving that it holds the job token without sending it
// (admission_proof.hpp):
//   1. dialler -> acceptor: greeting (its node, the node it means to reach, a fresh nonce);
//   2. acceptor -> dialler: greeting (its node, the dialler's, a fresh nonce), or the socket
//      closes where the dialler meant another node (a dial relayed, or reflected back to the
//      dialler's own listener);
//   3. dialler -> acceptor: request: the UCX addresses of its two workers, the key the
//      acceptor puts in front of every active message it sends on the connection, and its
//      proof over frames 1-3;
//   4. acceptor -> dialler: reply (admitted, with its own addresses, key and proof over
//      frames 1-4; or why not, unproven) and the socket closes.
// Both sides then make their endpoints from the worker addresses, one each way. UCX's own
// listener (ucp_listener_create) is not used: its connection manager aborts the process on a
// malformed frame (docs/transport.md), and it cannot connect processes that share memory only
// (UCX_TLS=sm,self).
//
// Everything read here is untrusted: sizes are bounded before anything is allocated, a
// socket silent past its deadline is closed, one source holds at most so many sockets at
// once, all sources together at most so many more, and no input closes the listener.
#pragma once

#include <asio/awaitable.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/steady_timer.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.hpp"
#include "transport/admission_proof.hpp"

namespace moevement::transport::detail {

constexpr std::uint32_t admission_magic = 0x4d44414d;  // "MADM"
constexpr std::uint32_t admission_version = 2;         // 2: challenge-response; 1 sent the token
constexpr std::size_t admission_max_token = 256;
constexpr std::size_t admission_max_address = 8192;  // a UCX worker address is a few hundred

// The first frame each way, in the sender's byte order (one host, or hosts of one job: all
// little-endian in practice; a mismatch reads as a bad magic).
struct admission_greeting {
  std::uint32_t magic = admission_magic;
  std::uint32_t version = admission_version;
  std::uint32_t node = 0;  // the sender's
  std::uint32_t peer = 0;  // the node it speaks to (both proofs cover it)
  nonce fresh{};
};
static_assert(sizeof(admission_greeting) == 48);

// The fixed part of a request and of a reply; the addresses, then the proof follow.
struct admission_head {
  std::uint32_t magic = admission_magic;
  std::uint32_t version = admission_version;
  std::uint32_t node = 0;
  std::uint32_t verdict = 0;        // a reply's; 0 in a request
  std::uint32_t message_bytes = 0;  // the message worker's address
  std::uint32_t bulk_bytes = 0;     // the bulk worker's address (with its host tag)
  std::uint64_t key = 0;            // put in front of every active message to the sender
};
static_assert(sizeof(admission_head) == 32);

enum class admission_verdict : std::uint32_t {
  admitted = 0,
  wrong_token = 1,  // the dialler's proof failed
  leaving = 2,      // the acceptor is shutting down
  unusable = 3,     // the acceptor could not make an endpoint of the dialler's address
  // Never on the wire: the dialler's verdict on an admission whose proof failed (the far end
  // does not hold the token).
  unproven = 4
};

struct admission_request {
  std::uint32_t node = 0;
  std::vector<std::byte> message_address;
  std::vector<std::byte> bulk_address;
  std::uint64_t key = 0;
};

struct admission_reply {
  std::uint32_t node = 0;
  admission_verdict verdict = admission_verdict::admitted;
  std::vector<std::byte> message_address;  // empty unless admitted
  std::vector<std::byte> bulk_address;
  std::uint64_t key = 0;
};

// The labels of the two proofs.
constexpr std::string_view request_label = "moevement admission request";
constexpr std::string_view reply_label = "moevement admission reply";

// Whether a greeting is one of ours (magic, version) from another node than `self`, meant for
// `self`.
result<void> check_greeting(const admission_greeting& g, std::uint32_t self);
// A frame without its proof: the head and the addresses.
std::vector<std::byte> encode(const admission_request& r);
std::vector<std::byte> encode(const admission_reply& r);
// The bytes that follow a head (addresses and proof), or why the head is not one of ours.
result<std::size_t> request_body_bytes(const admission_head& h);
result<std::size_t> reply_body_bytes(const admission_head& h);
admission_request decode_request(const admission_head& h, std::span<const std::byte> body);
admission_reply decode_reply(const admission_head& h, std::span<const std::byte> body);

// Why the listener refused a socket (the link counts and reports these). All but wrong_token
// close it without an answer.
enum class admission_refusal { malformed, timeout, half_open, too_many, wrong_token };

// The link's listening socket. Answers every well-formed request whose proof holds with
// decide()'s reply, and one whose proof fails with wrong_token.
class admission_listener : public std::enable_shared_from_this<admission_listener> {
 public:
  struct settings {
    std::chrono::milliseconds deadline;  // a socket's whole request must arrive within it
    std::size_t max_per_source;          // sockets open at once from one address
    std::size_t max_open;                // sockets open at once from all addresses
    std::uint32_t node;                  // the acceptor's, in its greeting
    std::string token;                   // the job token its proofs are keyed with
  };
  using decide_fn = std::function<admission_reply(const admission_request&, const std::string&)>;
  using refuse_fn = std::function<void(admission_refusal, const std::string& from)>;

  // Binds host:port (0: any free port) and starts accepting. Throws saying what to check.
  static std::shared_ptr<admission_listener> start(asio::io_context& io, const std::string& host,
                                                   std::uint16_t port, settings s, decide_fn decide,
                                                   refuse_fn refuse);
  std::uint16_t port() const { return port_; }
  // Stops accepting and closes every socket still open.
  void close();

  admission_listener(asio::io_context& io, settings s, decide_fn decide, refuse_fn refuse);

 private:
  void accept_next();
  asio::awaitable<void> serve(std::shared_ptr<asio::ip::tcp::socket> s, std::string from,
                              std::string source);

  asio::io_context& io_;
  settings settings_;
  decide_fn decide_;
  refuse_fn refuse_;
  asio::ip::tcp::acceptor acceptor_;
  asio::steady_timer retry_;  // after an accept error (out of descriptors): try again soon
  std::uint16_t port_ = 0;
  // One socket's exchange: the greetings, then answer().
  asio::awaitable<std::optional<admission_refusal>> greet(
      asio::ip::tcp::socket& s, const std::string& from,
      std::chrono::steady_clock::time_point expires);
  // After the greetings: the request of node `dialler` read, proven, answered.
  asio::awaitable<std::optional<admission_refusal>> answer(
      asio::ip::tcp::socket& s, std::vector<std::byte>& transcript, const std::string& from,
      std::chrono::steady_clock::time_point expires, std::uint32_t dialler);

  std::map<std::string, std::size_t> open_by_source_;
  std::set<std::shared_ptr<asio::ip::tcp::socket>> open_;
  bool closed_ = false;
};

// One dial under way (admission_dial).
class admission_dialing {
 public:
  explicit admission_dialing(asio::io_context& io) : socket(io), resolver(io) {}
  // Ends the dial early (with an error), wherever it is: resolving, connecting, exchanging.
  void give_up();

  asio::ip::tcp::socket socket;
  asio::ip::tcp::resolver resolver;
  bool given_up = false;
};

// One dial of node `peer`: resolve `host` (off the event loop: a slow name server must not hold the
// heartbeats), connect, greet, send the request with its proof, read the reply, all within
// `deadline`. An admission whose proof fails is the verdict `unproven` (the far end does not
// hold `token`); an admission comes only from node `peer` (another node's greeting ends the
// dial with an error). `done` runs once, from `io`.
std::shared_ptr<admission_dialing> admission_dial(
    asio::io_context& io, std::uint32_t peer, std::string host, std::uint16_t port,
    std::string token, const admission_request& request, std::chrono::milliseconds deadline,
    std::function<void(result<admission_reply>)> done);

// "host:port" (or "[v6]:port") of an endpoint, for reports.
std::string endpoint_text(const asio::ip::tcp::endpoint& e);

}  // namespace moevement::transport::detail
