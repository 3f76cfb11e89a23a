// The admission socket on its own, over loopback TCP in this process: the codec's bounds, a
// dial that is admitted or refused, the proofs both ways (the token never on the wire, a
// replayed request and an acceptor without the token refused), and what a hostile client gets
// (junk, a truncated request, silence, a flood from one source or from all): closed and
// reported, the listener listening on.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <asio/io_context.hpp>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "transport/ucx_link_admission.hpp"

namespace {

using namespace moevement;
using namespace moevement::transport::detail;
using namespace std::chrono_literals;

std::vector<std::byte> bytes(std::initializer_list<int> v) {
  std::vector<std::byte> out;
  for (int b : v) out.push_back(std::byte(b));
  return out;
}

admission_request request_of(std::uint32_t node) {
  return {node, bytes({1, 2, 3, 4}), bytes({9, 9}), 0x1122334455667788ull};
}

admission_head head_of(const std::vector<std::byte>& wire) {
  admission_head h;
  std::memcpy(&h, wire.data(), sizeof h);
  return h;
}

TEST(admission_codec, a_request_and_a_reply_read_back_as_written) {
  const auto r = request_of(7);
  auto wire = encode(r);
  wire.resize(wire.size() + proof_bytes);  // the proof is sealed on after
  const auto h = head_of(wire);
  ASSERT_TRUE(request_body_bytes(h).ok());
  EXPECT_EQ(*request_body_bytes(h) + sizeof h, wire.size());
  const auto back = decode_request(h, std::span(wire).subspan(sizeof h));
  EXPECT_EQ(back.node, 7u);
  EXPECT_EQ(back.message_address, r.message_address);
  EXPECT_EQ(back.bulk_address, r.bulk_address);
  EXPECT_EQ(back.key, r.key);

  const admission_reply reply{3, admission_verdict::admitted, bytes({5}), bytes({6, 7}), 42};
  auto rw = encode(reply);
  rw.resize(rw.size() + proof_bytes);
  const auto rh = head_of(rw);
  ASSERT_TRUE(reply_body_bytes(rh).ok());
  EXPECT_EQ(*reply_body_bytes(rh) + sizeof rh, rw.size());
  const auto rb = decode_reply(rh, std::span(rw).subspan(sizeof rh));
  EXPECT_EQ(rb.node, 3u);
  EXPECT_EQ(rb.verdict, admission_verdict::admitted);
  EXPECT_EQ(rb.message_address, reply.message_address);
  EXPECT_EQ(rb.bulk_address, reply.bulk_address);
  EXPECT_EQ(rb.key, 42u);
}

TEST(admission_codec, heads_past_their_bounds_are_refused_before_anything_is_read) {
  const auto good = head_of(encode(request_of(1)));
  auto bad = [&](auto change) {
    admission_head h = good;
    change(h);
    return !request_body_bytes(h).ok();
  };
  EXPECT_TRUE(bad([](admission_head& h) { h.magic = 0; }));
  EXPECT_TRUE(bad([](admission_head& h) { h.version = 99; }));
  EXPECT_TRUE(bad([](admission_head& h) { h.verdict = 1; }));
  EXPECT_TRUE(bad([](admission_head& h) { h.message_bytes = 0; }));
  EXPECT_TRUE(bad([](admission_head& h) { h.message_bytes = 0xffffffffu; }));
  EXPECT_TRUE(bad([](admission_head& h) { h.bulk_bytes = 8193; }));
  admission_head h = head_of(encode(admission_reply{1, admission_verdict::wrong_token, {}, {}, 0}));
  EXPECT_TRUE(reply_body_bytes(h).ok());
  h.message_bytes = 4;  // a refusal carries no address
  EXPECT_FALSE(reply_body_bytes(h).ok());
  h = head_of(encode(admission_reply{1, admission_verdict::admitted, {}, {}, 0}));
  EXPECT_FALSE(reply_body_bytes(h).ok()) << "an admission without an address";
  h.verdict = static_cast<std::uint32_t>(admission_verdict::unproven);
  h.message_bytes = 0;
  EXPECT_FALSE(reply_body_bytes(h).ok()) << "a verdict never sent";
  admission_greeting g;
  g.node = 5;
  g.peer = 0;
  EXPECT_TRUE(check_greeting(g, 0).ok());
  g.version = 1;  // the protocol that sent the token itself
  EXPECT_FALSE(check_greeting(g, 0).ok());
  g.version = admission_version;
  EXPECT_FALSE(check_greeting(g, 3).ok()) << "meant for node 0: a dial relayed to node 3";
  g.node = 0;
  EXPECT_FALSE(check_greeting(g, 0).ok()) << "from node 0 itself: a dial reflected";
}

TEST(admission_proof, a_proof_depends_on_the_token_the_label_and_every_byte) {
  const auto t = bytes({1, 2, 3});
  const proof p = prove("job", request_label, t);
  EXPECT_TRUE(same_proof(p, prove("job", request_label, t)));
  EXPECT_FALSE(same_proof(p, prove("jab", request_label, t)));
  EXPECT_FALSE(same_proof(p, prove("job", reply_label, t))) << "a request's proof is no reply's";
  EXPECT_FALSE(same_proof(p, prove("job", request_label, bytes({1, 2, 4}))));
  EXPECT_FALSE(same_proof(std::span(p).first(31), p));
  EXPECT_NE(fresh_nonce(), fresh_nonce());
}

// Blocking, whole reads and writes of a raw socket (run off the test's io thread).
bool read_all(int fd, void* to, std::size_t n) {
  auto* p = static_cast<char*>(to);
  while (n > 0) {
    const ssize_t got = ::recv(fd, p, n, 0);
    if (got <= 0) return false;
    p += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}
bool write_all(int fd, const void* from, std::size_t n) {
  return ::send(fd, from, n, MSG_NOSIGNAL) == ssize_t(n);
}
void add(std::vector<std::byte>& to, const void* p, std::size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  to.insert(to.end(), b, b + n);
}

// A process at a peer's old address (a freed port another user took) that does not hold the
// job token: it speaks the protocol, greets as the node the dialler means (node 0), keeps
// every byte the dialler sends, and admits it with a proof keyed by a token of its own.
class impostor {
 public:
  // greet_as: the node it says it is (-1: the one the dialler means).
  explicit impostor(std::int64_t greet_as = -1) : greet_as_(greet_as) {
    listen_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    EXPECT_EQ(::bind(listen_, reinterpret_cast<const sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::listen(listen_, 1), 0);
    ::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~impostor() {
    if (thread_.joinable()) thread_.join();
    ::close(listen_);
  }
  std::uint16_t port() const { return port_; }
  // Every byte the dialler sent, once the exchange is over.
  const std::vector<std::byte>& heard() {
    thread_.join();
    return heard_;
  }

 private:
  void serve() {
    const int s = ::accept(listen_, nullptr, nullptr);
    admission_greeting theirs;
    admission_greeting mine;
    admission_head h;
    if (s >= 0 && read_all(s, &theirs, sizeof theirs)) {
      mine.node = greet_as_ < 0 ? theirs.peer : std::uint32_t(greet_as_);
      mine.peer = theirs.node;
      mine.fresh = fresh_nonce();
    }
    if (s >= 0 && greet_as_ >= 0) {  // the dialler closes: it heard another node than it dials
      add(heard_, &theirs, sizeof theirs);
      char c = 0;
      EXPECT_TRUE(write_all(s, &mine, sizeof mine) && ::recv(s, &c, 1, 0) <= 0);
      ::close(s);
      return;
    }
    if (s < 0 || !write_all(s, &mine, sizeof mine) || !read_all(s, &h, sizeof h) ||
        !request_body_bytes(h).ok()) {
      ADD_FAILURE() << "the dialler did not speak the protocol";
      if (s >= 0) ::close(s);
      return;
    }
    std::vector<std::byte> body(*request_body_bytes(h));
    EXPECT_TRUE(read_all(s, body.data(), body.size()));
    add(heard_, &theirs, sizeof theirs);
    add(heard_, &h, sizeof h);
    add(heard_, body.data(), body.size());
    std::vector<std::byte> transcript = heard_;
    transcript.insert(transcript.begin() + sizeof theirs, reinterpret_cast<std::byte*>(&mine),
                      reinterpret_cast<std::byte*>(&mine) + sizeof mine);
    auto reply = encode(admission_reply{0, admission_verdict::admitted, bytes({8}), {}, 99});
    add(transcript, reply.data(), reply.size());
    const proof forged = prove("not the job token", reply_label, transcript);
    add(reply, forged.data(), forged.size());
    EXPECT_TRUE(write_all(s, reply.data(), reply.size()));
    ::close(s);
  }

  std::int64_t greet_as_;
  int listen_ = -1;
  std::uint16_t port_ = 0;
  std::thread thread_;
  std::vector<std::byte> heard_;
};

class admission_test : public ::testing::Test {
 protected:
  void listen(std::chrono::milliseconds deadline = 2000ms, std::size_t per_source = 8,
              std::size_t all = 64) {
    listener_ = admission_listener::start(
        io_, "127.0.0.1", 0, {deadline, per_source, all, 0, "job"},
        [this](const admission_request& r, const std::string&) {
          asked_.push_back(r);
          return admission_reply{0, admission_verdict::admitted, bytes({8}), {}, 99};
        },
        [this](admission_refusal why, const std::string& from) {
          refused_.push_back(why);
          EXPECT_EQ(from.rfind("127.0.0.1:", 0), 0u) << from;
        });
  }
  void TearDown() override {
    if (listener_) listener_->close();
    io_.run_for(50ms);
  }
  template <class Pred>
  bool run_until(Pred pred, std::chrono::milliseconds limit = 10s) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!pred()) {
      if (std::chrono::steady_clock::now() > until) return false;
      io_.restart();
      io_.run_for(2ms);
    }
    return true;
  }
  int connect_raw() {
    const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(listener_->port());
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(s, reinterpret_cast<const sockaddr*>(&a), sizeof a), 0);
    return s;
  }
  std::optional<result<admission_reply>> dial(const admission_request& r,
                                              const std::string& token = "job",
                                              std::uint16_t port = 0) {
    std::optional<result<admission_reply>> got;
    admission_dial(io_, 0, "127.0.0.1", port != 0 ? port : listener_->port(), token, r, 2000ms,
                   [&](result<admission_reply> reply) { got = reply; });
    run_until([&] { return got.has_value(); });
    return got;
  }

  asio::io_context io_;
  std::shared_ptr<admission_listener> listener_;
  std::vector<admission_request> asked_;
  std::vector<admission_refusal> refused_;
};

TEST_F(admission_test, a_dial_is_answered_with_the_verdict_decide_gives) {
  listen();
  auto got = dial(request_of(5));
  ASSERT_TRUE(got && got->ok()) << (got ? got->err().message : "no answer");
  EXPECT_EQ((*got)->verdict, admission_verdict::admitted) << "both proofs held";
  EXPECT_EQ((*got)->key, 99u);
  EXPECT_EQ((*got)->message_address, bytes({8}));
  ASSERT_EQ(asked_.size(), 1u);
  EXPECT_EQ(asked_[0].node, 5u);
  EXPECT_EQ(asked_[0].key, 0x1122334455667788ull);
  got = dial(request_of(6), "another job");
  ASSERT_TRUE(got && got->ok());
  EXPECT_EQ((*got)->verdict, admission_verdict::wrong_token);
  EXPECT_EQ(asked_.size(), 1u) << "decide() was asked about a dialler without the token";
  ASSERT_TRUE(run_until([&] { return refused_.size() == 1; }));
  EXPECT_EQ(refused_[0], admission_refusal::wrong_token);
}

TEST_F(admission_test, the_token_never_goes_on_the_wire_and_an_acceptor_without_it_is_not_trusted) {
  impostor at_old_address;
  const std::string token = "the job token, 0123456789abcdef";
  const auto got = dial(request_of(5), token, at_old_address.port());
  ASSERT_TRUE(got && got->ok()) << (got ? got->err().message : "no answer");
  EXPECT_EQ((*got)->verdict, admission_verdict::unproven) << "an admission without a proof";
  const auto& heard = at_old_address.heard();
  EXPECT_GT(heard.size(), sizeof(admission_greeting) + sizeof(admission_head))
      << "the impostor heard the whole request";
  const auto* t = reinterpret_cast<const std::byte*>(token.data());
  EXPECT_EQ(std::search(heard.begin(), heard.end(), t, t + token.size()), heard.end())
      << "the job token went on the wire";
}

TEST_F(admission_test, a_request_proven_for_another_exchange_is_refused) {
  listen();
  // A request recorded from another exchange, played again: its proof covers that exchange's
  // nonces, not this one's.
  std::optional<admission_verdict> verdict;
  std::thread replayer([&, fd = connect_raw()] {
    admission_greeting mine;
    mine.node = 5;
    mine.fresh = fresh_nonce();
    admission_greeting theirs;
    admission_greeting old = theirs;
    old.fresh = fresh_nonce();  // the acceptor's nonce of the exchange it was recorded in
    std::vector<std::byte> transcript;
    add(transcript, &mine, sizeof mine);
    add(transcript, &old, sizeof old);
    auto frame = encode(request_of(5));
    add(transcript, frame.data(), frame.size());
    const proof stale = prove("job", request_label, transcript);
    add(frame, stale.data(), stale.size());
    admission_head h;
    if (write_all(fd, &mine, sizeof mine) && read_all(fd, &theirs, sizeof theirs) &&
        write_all(fd, frame.data(), frame.size()) && read_all(fd, &h, sizeof h)) {
      verdict = static_cast<admission_verdict>(h.verdict);
    }
    ::close(fd);
  });
  EXPECT_TRUE(run_until([&] { return refused_.size() == 1; }));
  replayer.join();
  EXPECT_EQ(verdict, admission_verdict::wrong_token);
  EXPECT_TRUE(asked_.empty()) << "decide() was asked about a replayed request";
  ASSERT_EQ(refused_.size(), 1u);
  EXPECT_EQ(refused_[0], admission_refusal::wrong_token);
}

// A dial is for one node: the greeting names it, and both proofs cover it. A greeting meant
// for another node (a dial relayed here) or from this node itself (reflected back to its own
// listener) is closed before anything is proven; and a dialler that is greeted by another node
// than the one it dials stops before it sends its proof.
TEST_F(admission_test, a_dial_relayed_or_reflected_is_closed_unproven) {
  listen();
  for (const std::uint32_t peer : {7u, 0u}) {
    std::optional<bool> closed;
    std::thread dialler([&, fd = connect_raw()] {
      admission_greeting g;
      g.node = peer == 0 ? 0 : 5;  // reflected: from the listener's own node
      g.peer = peer;               // relayed: meant for node 7
      g.fresh = fresh_nonce();
      char c = 0;
      closed = write_all(fd, &g, sizeof g) && ::recv(fd, &c, 1, 0) <= 0;
      ::close(fd);
    });
    EXPECT_TRUE(run_until([&] { return closed.has_value(); }));
    dialler.join();
    EXPECT_EQ(closed, std::optional(true)) << "greeted back, peer " << peer;
  }
  EXPECT_TRUE(run_until([&] { return refused_.size() == 2; }));
  EXPECT_EQ(std::count(refused_.begin(), refused_.end(), admission_refusal::malformed), 2);
  EXPECT_TRUE(asked_.empty());
  // A dialler greeted by another node than it dials (node 3 where it means node 0) closes
  // before it sends anything more.
  impostor other_node(3);
  const auto got = dial(request_of(5), "job", other_node.port());
  ASSERT_TRUE(got && !got->ok());
  EXPECT_NE(got->err().message.find("node 3 answered at node 0's address"), std::string::npos)
      << got->err().message;
  EXPECT_EQ(other_node.heard().size(), sizeof(admission_greeting));
  EXPECT_TRUE(asked_.empty());
}

TEST_F(admission_test, junk_truncation_and_silence_are_closed_and_the_listener_listens_on) {
  listen(300ms);
  const int junk = connect_raw();
  const std::vector<char> zeros(64, 0);
  ASSERT_EQ(::send(junk, zeros.data(), zeros.size(), MSG_NOSIGNAL), 64);
  const int truncated = connect_raw();
  const admission_greeting wire;
  ASSERT_EQ(::send(truncated, &wire, sizeof wire - 1, MSG_NOSIGNAL), ssize_t(sizeof wire - 1));
  ::close(truncated);  // the last byte never comes
  const int silent = connect_raw();
  ASSERT_TRUE(run_until([&] { return refused_.size() == 3; }));
  EXPECT_EQ(std::count(refused_.begin(), refused_.end(), admission_refusal::malformed), 2);
  EXPECT_EQ(std::count(refused_.begin(), refused_.end(), admission_refusal::timeout), 1);
  char c = 0;
  // (closed with bytes unread: a reset rather than an end of stream)
  EXPECT_LE(::recv(junk, &c, 1, 0), 0) << "junk is closed without an answer";
  EXPECT_EQ(::recv(silent, &c, 1, 0), 0) << "silence is closed after the deadline";
  ::close(junk);
  ::close(silent);
  EXPECT_TRUE(asked_.empty());
  const auto got = dial(request_of(5));
  ASSERT_TRUE(got && got->ok()) << "the listener stopped listening";
}

TEST_F(admission_test, one_source_holds_only_so_many_sockets) {
  listen(10s, 2);
  std::vector<int> open{connect_raw(), connect_raw()};
  run_until([] { return false; }, 50ms);
  const int third = connect_raw();
  ASSERT_TRUE(run_until([&] { return refused_.size() == 1; }));
  EXPECT_EQ(refused_[0], admission_refusal::half_open);
  char c = 0;
  EXPECT_EQ(::recv(third, &c, 1, 0), 0) << "the socket past the limit is closed at once";
  ::close(third);
  ::close(open[0]);  // one closes: room for a real dialler
  run_until([] { return false; }, 50ms);
  const auto got = dial(request_of(5));
  ASSERT_TRUE(got && got->ok()) << (got ? got->err().message : "no answer");
  ::close(open[1]);
}

TEST_F(admission_test, all_sources_together_hold_only_so_many_sockets) {
  listen(10s, 8, 2);
  std::vector<int> open{connect_raw(), connect_raw()};
  run_until([] { return false; }, 50ms);
  const int third = connect_raw();
  ASSERT_TRUE(run_until([&] { return refused_.size() == 1; }));
  EXPECT_EQ(refused_[0], admission_refusal::too_many);
  char c = 0;
  EXPECT_EQ(::recv(third, &c, 1, 0), 0) << "the socket past the limit is closed at once";
  ::close(third);
  ::close(open[0]);
  run_until([] { return false; }, 50ms);
  const auto got = dial(request_of(5));
  ASSERT_TRUE(got && got->ok()) << (got ? got->err().message : "no answer");
  ::close(open[1]);
}

// Names are resolved off the event loop (a slow name server held the heartbeats): a dial to a
// name (from /etc/hosts: no query leaves the machine) is admitted, and one given up while
// resolving ends at once, never reaching the acceptor.
TEST_F(admission_test, a_dial_by_name_resolves_off_the_loop_and_can_be_given_up) {
  listen();
  std::optional<result<admission_reply>> got;
  admission_dial(io_, 0, "localhost", listener_->port(), "job", request_of(1), 5000ms,
                 [&](result<admission_reply> r) { got = r; });
  ASSERT_TRUE(run_until([&] { return got.has_value(); }));
  ASSERT_TRUE(got->ok()) << got->err().message;
  EXPECT_EQ((*got)->verdict, admission_verdict::admitted);
  got.reset();
  auto d = admission_dial(io_, 0, "localhost", listener_->port(), "job", request_of(2), 5000ms,
                          [&](result<admission_reply> r) { got = r; });
  d->give_up();
  ASSERT_TRUE(run_until([&] { return got.has_value(); }));
  ASSERT_FALSE(got->ok());
  EXPECT_NE(got->err().message.find("given up"), std::string::npos) << got->err().message;
  EXPECT_EQ(asked_.size(), 1u) << "a dial given up reached the acceptor";
}

TEST_F(admission_test, a_dial_to_nobody_fails_saying_where) {
  listen();
  const auto port = listener_->port();
  listener_->close();
  listener_.reset();
  std::optional<result<admission_reply>> got;
  admission_dial(io_, 0, "127.0.0.1", port, "job", request_of(1), 1000ms,
                 [&](result<admission_reply> r) { got = r; });
  ASSERT_TRUE(run_until([&] { return got.has_value(); }));
  ASSERT_FALSE(got->ok());
  EXPECT_NE(got->err().message.find("127.0.0.1:" + std::to_string(port)), std::string::npos)
      << got->err().message;
}

}  // namespace
