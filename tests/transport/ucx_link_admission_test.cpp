// The admission socket on its own, over loopback TCP in this process: the codec's bounds, a
// dial that is admitted or refused, and what a hostile client gets (junk, a truncated request,
// silence, a flood from one source): closed and reported, the listener listening on.
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

admission_request request_of(std::uint32_t node, const std::string& token) {
  return {node, token, bytes({1, 2, 3, 4}), bytes({9, 9}), 0x1122334455667788ull};
}

admission_head head_of(const std::vector<std::byte>& wire) {
  admission_head h;
  std::memcpy(&h, wire.data(), sizeof h);
  return h;
}

TEST(admission_codec, a_request_and_a_reply_read_back_as_written) {
  const auto r = request_of(7, "token");
  const auto wire = encode(r);
  const auto h = head_of(wire);
  ASSERT_TRUE(request_body_bytes(h).ok());
  EXPECT_EQ(*request_body_bytes(h) + sizeof h, wire.size());
  const auto back = decode_request(h, std::span(wire).subspan(sizeof h));
  EXPECT_EQ(back.node, 7u);
  EXPECT_EQ(back.token, "token");
  EXPECT_EQ(back.message_address, r.message_address);
  EXPECT_EQ(back.bulk_address, r.bulk_address);
  EXPECT_EQ(back.key, r.key);

  const admission_reply reply{3, admission_verdict::admitted, bytes({5}), bytes({6, 7}), 42};
  const auto rw = encode(reply);
  const auto rh = head_of(rw);
  ASSERT_TRUE(reply_body_bytes(rh).ok());
  const auto rb = decode_reply(rh, std::span(rw).subspan(sizeof rh));
  EXPECT_EQ(rb.node, 3u);
  EXPECT_EQ(rb.verdict, admission_verdict::admitted);
  EXPECT_EQ(rb.message_address, reply.message_address);
  EXPECT_EQ(rb.bulk_address, reply.bulk_address);
  EXPECT_EQ(rb.key, 42u);
}

TEST(admission_codec, heads_past_their_bounds_are_refused_before_anything_is_read) {
  const auto good = head_of(encode(request_of(1, "t")));
  auto bad = [&](auto change) {
    admission_head h = good;
    change(h);
    return !request_body_bytes(h).ok();
  };
  EXPECT_TRUE(bad([](admission_head& h) { h.magic = 0; }));
  EXPECT_TRUE(bad([](admission_head& h) { h.version = 99; }));
  EXPECT_TRUE(bad([](admission_head& h) { h.token_or_verdict = 0; }));
  EXPECT_TRUE(bad([](admission_head& h) { h.token_or_verdict = 257; }));
  EXPECT_TRUE(bad([](admission_head& h) { h.message_bytes = 0; }));
  EXPECT_TRUE(bad([](admission_head& h) { h.message_bytes = 0xffffffffu; }));
  EXPECT_TRUE(bad([](admission_head& h) { h.bulk_bytes = 8193; }));
  admission_head h = head_of(encode(admission_reply{1, admission_verdict::wrong_token, {}, {}, 0}));
  EXPECT_TRUE(reply_body_bytes(h).ok());
  h.message_bytes = 4;  // a refusal carries no address
  EXPECT_FALSE(reply_body_bytes(h).ok());
  h = head_of(encode(admission_reply{1, admission_verdict::admitted, {}, {}, 0}));
  EXPECT_FALSE(reply_body_bytes(h).ok()) << "an admission without an address";
  h.token_or_verdict = 4;
  EXPECT_FALSE(reply_body_bytes(h).ok()) << "an unknown verdict";
}

class admission_test : public ::testing::Test {
 protected:
  void listen(admission_listener::settings s = {2000ms, 8}) {
    listener_ = admission_listener::start(
        io_, "127.0.0.1", 0, s,
        [this](const admission_request& r, const std::string&) {
          asked_.push_back(r);
          admission_reply reply{0, admission_verdict::wrong_token, {}, {}, 0};
          if (r.token == "job") reply = {0, admission_verdict::admitted, bytes({8}), {}, 99};
          return reply;
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
                                              std::chrono::milliseconds deadline = 2000ms) {
    std::optional<result<admission_reply>> got;
    const asio::ip::tcp::endpoint to(asio::ip::make_address("127.0.0.1"), listener_->port());
    admission_dial(io_, to, r, deadline, [&](result<admission_reply> reply) { got = reply; });
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
  auto got = dial(request_of(5, "job"));
  ASSERT_TRUE(got && got->ok()) << (got ? got->err().message : "no answer");
  EXPECT_EQ((*got)->verdict, admission_verdict::admitted);
  EXPECT_EQ((*got)->key, 99u);
  EXPECT_EQ((*got)->message_address, bytes({8}));
  ASSERT_EQ(asked_.size(), 1u);
  EXPECT_EQ(asked_[0].node, 5u);
  EXPECT_EQ(asked_[0].key, 0x1122334455667788ull);
  got = dial(request_of(6, "another job"));
  ASSERT_TRUE(got && got->ok());
  EXPECT_EQ((*got)->verdict, admission_verdict::wrong_token);
  EXPECT_TRUE(refused_.empty()) << "a wrong token is decide's to count, not the listener's";
}

TEST_F(admission_test, junk_truncation_and_silence_are_closed_and_the_listener_listens_on) {
  listen({300ms, 8});
  const int junk = connect_raw();
  const std::vector<char> zeros(64, 0);
  ASSERT_EQ(::send(junk, zeros.data(), zeros.size(), MSG_NOSIGNAL), 64);
  const int truncated = connect_raw();
  const auto wire = encode(request_of(1, "job"));
  ASSERT_EQ(::send(truncated, wire.data(), wire.size() - 1, MSG_NOSIGNAL),
            ssize_t(wire.size() - 1));
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
  const auto got = dial(request_of(5, "job"));
  ASSERT_TRUE(got && got->ok()) << "the listener stopped listening";
}

TEST_F(admission_test, one_source_holds_only_so_many_sockets) {
  listen({10s, 2});
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
  const auto got = dial(request_of(5, "job"));
  ASSERT_TRUE(got && got->ok()) << (got ? got->err().message : "no answer");
  ::close(open[1]);
}

TEST_F(admission_test, a_dial_to_nobody_fails_saying_where) {
  listen();
  const auto port = listener_->port();
  listener_->close();
  listener_.reset();
  std::optional<result<admission_reply>> got;
  const asio::ip::tcp::endpoint to(asio::ip::make_address("127.0.0.1"), port);
  admission_dial(io_, to, request_of(1, "job"), 1000ms,
                 [&](result<admission_reply> r) { got = r; });
  ASSERT_TRUE(run_until([&] { return got.has_value(); }));
  ASSERT_FALSE(got->ok());
  EXPECT_NE(got->err().message.find("127.0.0.1:" + std::to_string(port)), std::string::npos)
      << got->err().message;
}

}  // namespace
