#include "transport/ucx_link_admission.hpp"

#include <fcntl.h>
#include <fmt/format.h>

#include <asio/buffer.hpp>
#include <asio/co_spawn.hpp>
#include <asio/connect.hpp>
#include <asio/detached.hpp>
#include <asio/read.hpp>
#include <asio/redirect_error.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/write.hpp>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string_view>

namespace moevement::transport::detail {
namespace {

using asio::ip::tcp;
using clock = std::chrono::steady_clock;

void append(std::vector<std::byte>& out, const void* p, std::size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  out.insert(out.end(), b, b + n);
}

// Our sockets are not a child's (the launcher's workers are started from the head).
void close_on_exec(int fd) {
  ::fcntl(fd, F_SETFD, ::fcntl(fd, F_GETFD) | FD_CLOEXEC);
}

result<void> check_version(std::uint32_t magic, std::uint32_t version) {
  if (magic != admission_magic) return error{"not a moevement link (bad magic)"};
  if (version != admission_version) {
    return error{fmt::format("admission protocol {} where this build speaks {} (mixed builds?)",
                             version, admission_version)};
  }
  return {};
}

result<void> check_common(const admission_head& h) {
  if (auto ok = check_version(h.magic, h.version); !ok.ok()) return ok;
  if (h.message_bytes > admission_max_address || h.bulk_bytes > admission_max_address) {
    return error{"a worker address longer than any UCX makes"};
  }
  return {};
}

std::vector<std::byte> slice(std::span<const std::byte> body, std::size_t& at, std::size_t n) {
  std::vector<std::byte> out(body.begin() + static_cast<std::ptrdiff_t>(at),
                             body.begin() + static_cast<std::ptrdiff_t>(at + n));
  at += n;
  return out;
}

// Why a socket's read or write failed: silence past its deadline, else not one of ours.
admission_refusal read_failed(clock::time_point expires) {
  return clock::now() >= expires ? admission_refusal::timeout : admission_refusal::malformed;
}

// A frame's body ends with its proof.
std::span<const std::byte> proof_of(std::span<const std::byte> body) {
  return body.last(proof_bytes);
}

// Appends a frame (head and body but the proof) to the transcript.
void take_in(std::vector<std::byte>& transcript, const admission_head& h,
             std::span<const std::byte> body) {
  append(transcript, &h, sizeof h);
  append(transcript, body.data(), body.size() - proof_bytes);
}

// Appends `token`'s proof over the transcript (which the frame ends) to the frame and to the
// transcript.
void seal(std::vector<std::byte>& frame, std::vector<std::byte>& transcript,
          const std::string& token, std::string_view label) {
  const proof p = prove(token, label, transcript);
  append(frame, p.data(), p.size());
  append(transcript, p.data(), p.size());
}

// The dialler's side of the four frames (ucx_link_admission.hpp), after the connect: the
// reply, or why not.
asio::awaitable<result<admission_reply>> dial_frames(
    tcp::socket& s, std::uint32_t peer, const std::string& token, const admission_request& request,
    const std::function<error(const char*, std::error_code)>& fail) {
  std::error_code ec;
  auto on = asio::redirect_error(asio::use_awaitable, ec);
  admission_greeting mine;
  mine.node = request.node;
  mine.peer = peer;
  mine.fresh = fresh_nonce();
  co_await asio::async_write(s, asio::buffer(&mine, sizeof mine), on);
  if (ec) co_return fail("send", ec);
  admission_greeting theirs{};
  co_await asio::async_read(s, asio::buffer(&theirs, sizeof theirs), on);
  if (ec) co_return fail("greeting", ec);
  if (auto ok = check_greeting(theirs, request.node); !ok.ok()) co_return ok.err();
  if (theirs.node != peer) {  // before any proof is sent
    co_return error{
        fmt::format("node {} answered at node {}'s address (is another job listening "
                    "there?)",
                    theirs.node, peer)};
  }
  std::vector<std::byte> transcript;
  append(transcript, &mine, sizeof mine);
  append(transcript, &theirs, sizeof theirs);
  auto frame = encode(request);
  append(transcript, frame.data(), frame.size());
  seal(frame, transcript, token, request_label);
  co_await asio::async_write(s, asio::buffer(frame), on);
  if (ec) co_return fail("send", ec);
  admission_head h{};
  co_await asio::async_read(s, asio::buffer(&h, sizeof h), on);
  if (ec) co_return fail("reply", ec);
  const auto body_bytes = reply_body_bytes(h);
  if (!body_bytes.ok()) co_return body_bytes.err();
  std::vector<std::byte> body(*body_bytes);
  co_await asio::async_read(s, asio::buffer(body), on);
  if (ec) co_return fail("reply", ec);
  auto reply = decode_reply(h, body);
  if (reply.verdict != admission_verdict::admitted) co_return reply;  // a refusal proves nothing
  take_in(transcript, h, body);
  if (!same_proof(proof_of(body), prove(token, reply_label, transcript))) {
    co_return admission_reply{reply.node, admission_verdict::unproven, {}, {}, 0};
  }
  if (reply.node != theirs.node) {
    co_return error{fmt::format("node {} greeted, node {} replied", theirs.node, reply.node)};
  }
  co_return reply;
}

asio::awaitable<void> dial_exchange(std::shared_ptr<admission_dialing> d, std::uint32_t peer,
                                    std::string host, std::uint16_t port, std::string token,
                                    admission_request request, std::chrono::milliseconds deadline,
                                    std::function<void(result<admission_reply>)> done) {
  const auto expires = clock::now() + deadline;
  asio::steady_timer timer(d->socket.get_executor(), deadline);
  timer.async_wait([d](std::error_code ec) {
    if (ec) return;
    d->resolver.cancel();
    std::error_code ignored;
    d->socket.close(ignored);
  });
  const std::function<error(const char*, std::error_code)> fail = [&](const char* step,
                                                                      std::error_code ec) {
    const std::string why = d->given_up ? std::string("given up")
                            : clock::now() >= expires
                                ? fmt::format("no answer within {} ms", deadline.count())
                                : ec.message();
    return error{fmt::format("{} failed: {}", step, why)};
  };
  std::string where = fmt::format("{}:{}", host, port);
  result<admission_reply> got = error{""};
  std::error_code ec;
  const auto found = co_await d->resolver.async_resolve(
      host, std::to_string(port), asio::redirect_error(asio::use_awaitable, ec));
  if (ec || d->given_up || found.empty()) {
    got = d->given_up || clock::now() >= expires
              ? fail("resolving", ec)
              : error{fmt::format("cannot resolve '{}': {} (give a host name or an IP address "
                                  "this machine can reach)",
                                  host, ec ? ec.message() : std::string("no address"))};
  } else {
    // Every address the name has, in turn (localhost may be ::1 first, the peer on 127.0.0.1).
    const auto to = co_await asio::async_connect(d->socket, found,
                                                 asio::redirect_error(asio::use_awaitable, ec));
    if (ec || d->given_up) {
      got = fail("connect", ec);
    } else {
      where = endpoint_text(to);
      close_on_exec(d->socket.native_handle());
      auto reply =
          co_await dial_frames(d->socket, peer, token, request, fail);  // (g++ 12: not in ?:)
      got = std::move(reply);
    }
  }
  timer.cancel();
  d->socket.close(ec);
  if (!got.ok()) got = error{fmt::format("admission at {}: {}", where, got.err().message)};
  done(std::move(got));
}

}  // namespace

std::string endpoint_text(const tcp::endpoint& e) {
  const auto a = e.address();
  return a.is_v6() ? fmt::format("[{}]:{}", a.to_string(), e.port())
                   : fmt::format("{}:{}", a.to_string(), e.port());
}

namespace {

// A head (its sizes from the addresses), then the addresses; the proof is sealed on after.
std::vector<std::byte> frame(std::uint32_t node, std::uint32_t verdict,
                             const std::vector<std::byte>& message,
                             const std::vector<std::byte>& bulk, std::uint64_t key) {
  admission_head h;
  h.node = node;
  h.verdict = verdict;
  h.message_bytes = static_cast<std::uint32_t>(message.size());
  h.bulk_bytes = static_cast<std::uint32_t>(bulk.size());
  h.key = key;
  std::vector<std::byte> out;
  append(out, &h, sizeof h);
  append(out, message.data(), message.size());
  append(out, bulk.data(), bulk.size());
  return out;
}

}  // namespace

result<void> check_greeting(const admission_greeting& g, std::uint32_t self) {
  if (auto ok = check_version(g.magic, g.version); !ok.ok()) return ok;
  if (g.node == self) return error{"a greeting from this node itself (a dial reflected)"};
  if (g.peer != self) {
    return error{fmt::format("a greeting meant for node {}, not this node {} (a dial relayed?)",
                             g.peer, self)};
  }
  return {};
}

std::vector<std::byte> encode(const admission_request& r) {
  return frame(r.node, 0, r.message_address, r.bulk_address, r.key);
}

std::vector<std::byte> encode(const admission_reply& r) {
  return frame(r.node, static_cast<std::uint32_t>(r.verdict), r.message_address, r.bulk_address,
               r.key);
}

result<std::size_t> request_body_bytes(const admission_head& h) {
  if (auto ok = check_common(h); !ok.ok()) return ok.err();
  if (h.verdict != 0) return error{"a request with a verdict"};
  if (h.message_bytes == 0) return error{"no worker address"};
  return std::size_t{h.message_bytes} + h.bulk_bytes + proof_bytes;
}

result<std::size_t> reply_body_bytes(const admission_head& h) {
  if (auto ok = check_common(h); !ok.ok()) return ok.err();
  if (h.verdict > static_cast<std::uint32_t>(admission_verdict::unusable)) {
    return error{fmt::format("unknown verdict {}", h.verdict)};
  }
  const bool admitted = h.verdict == 0;
  if (admitted != (h.message_bytes != 0)) return error{"a verdict that does not fit its addresses"};
  return std::size_t{h.message_bytes} + h.bulk_bytes + proof_bytes;
}

admission_request decode_request(const admission_head& h, std::span<const std::byte> body) {
  admission_request r;
  r.node = h.node;
  r.key = h.key;
  std::size_t at = 0;
  r.message_address = slice(body, at, h.message_bytes);
  r.bulk_address = slice(body, at, h.bulk_bytes);
  return r;
}

admission_reply decode_reply(const admission_head& h, std::span<const std::byte> body) {
  admission_reply r;
  r.node = h.node;
  r.verdict = static_cast<admission_verdict>(h.verdict);
  r.key = h.key;
  std::size_t at = 0;
  r.message_address = slice(body, at, h.message_bytes);
  r.bulk_address = slice(body, at, h.bulk_bytes);
  return r;
}

// ---- the listener ---------------------------------------------------------------------------

admission_listener::admission_listener(asio::io_context& io, settings s, decide_fn decide,
                                       refuse_fn refuse)
    : io_(io),
      settings_(s),
      decide_(std::move(decide)),
      refuse_(std::move(refuse)),
      acceptor_(io),
      retry_(io) {}

std::shared_ptr<admission_listener> admission_listener::start(asio::io_context& io,
                                                              const std::string& host,
                                                              std::uint16_t port, settings s,
                                                              decide_fn decide, refuse_fn refuse) {
  auto l = std::make_shared<admission_listener>(io, s, std::move(decide), std::move(refuse));
  try {
    tcp::resolver resolver(io);
    const tcp::endpoint at =
        *resolver.resolve(host, std::to_string(port), tcp::resolver::passive).begin();
    l->acceptor_.open(at.protocol());
    close_on_exec(l->acceptor_.native_handle());
    l->acceptor_.set_option(tcp::acceptor::reuse_address(true));
    l->acceptor_.bind(at);
    l->acceptor_.listen();
    l->port_ = l->acceptor_.local_endpoint().port();
  } catch (const std::system_error& e) {
    throw std::runtime_error(fmt::format(
        "cannot listen on {}:{}: {} (cluster.host must be an address of this machine, and "
        "the port free)",
        host, port, e.what()));
  }
  l->accept_next();
  return l;
}

void admission_listener::close() {
  closed_ = true;
  std::error_code ignored;
  acceptor_.close(ignored);
  retry_.cancel();
  for (const auto& s : open_) s->close(ignored);
}

void admission_listener::accept_next() {
  if (closed_) return;
  acceptor_.async_accept([self = shared_from_this()](std::error_code ec, tcp::socket s) {
    if (self->closed_) return;
    if (ec) {
      // Out of descriptors, or a connection reset before we took it: never a reason to stop
      // listening. A pause, so that a persistent error does not spin.
      self->retry_.expires_after(std::chrono::milliseconds(10));
      self->retry_.async_wait([self](std::error_code e) {
        if (!e) self->accept_next();
      });
      return;
    }
    close_on_exec(s.native_handle());
    std::error_code e;
    const tcp::endpoint remote = s.remote_endpoint(e);
    const std::string from = e ? std::string("?") : endpoint_text(remote);
    const std::string source = e ? std::string("?") : remote.address().to_string();
    const auto held = self->open_by_source_.find(source);
    if (held != self->open_by_source_.end() && held->second >= self->settings_.max_per_source) {
      self->refuse_(admission_refusal::half_open, from);
      s.close(e);
    } else if (self->open_.size() >= self->settings_.max_open) {  // (no entry made above)
      self->refuse_(admission_refusal::too_many, from);
      s.close(e);
    } else {
      ++self->open_by_source_[source];
      auto socket = std::make_shared<tcp::socket>(std::move(s));
      self->open_.insert(socket);
      asio::co_spawn(self->io_, self->serve(socket, from, source), asio::detached);
    }
    self->accept_next();
  });
}

asio::awaitable<void> admission_listener::serve(std::shared_ptr<tcp::socket> s, std::string from,
                                                std::string source) {
  auto self = shared_from_this();
  const auto expires = clock::now() + settings_.deadline;
  asio::steady_timer timer(io_, settings_.deadline);
  timer.async_wait([s](std::error_code ec) {
    std::error_code ignored;
    if (!ec) s->close(ignored);
  });
  std::optional<admission_refusal> refusal;
  try {
    auto refused = co_await greet(*s, from, expires);  // (g++ 12: bound before use)
    refusal = refused;
  } catch (const std::exception&) {
    // Ours, not the client's (no nonce, decide() failed): the socket is closed, never leaked.
    refusal = admission_refusal::malformed;
  }
  timer.cancel();
  std::error_code ec;
  s->close(ec);
  open_.erase(s);
  if (auto it = open_by_source_.find(source); it != open_by_source_.end() && --it->second == 0) {
    open_by_source_.erase(it);
  }
  if (refusal && !closed_) refuse_(*refusal, from);
}

asio::awaitable<std::optional<admission_refusal>> admission_listener::greet(
    tcp::socket& s, const std::string& from, clock::time_point expires) {
  std::error_code ec;
  auto on = asio::redirect_error(asio::use_awaitable, ec);
  admission_greeting theirs{};
  co_await asio::async_read(s, asio::buffer(&theirs, sizeof theirs), on);
  if (ec) co_return read_failed(expires);
  // Not ours, or meant for another node (relayed), or from this node itself (reflected): closed
  // before anything is proven.
  if (!check_greeting(theirs, settings_.node).ok()) co_return admission_refusal::malformed;
  admission_greeting mine;
  mine.node = settings_.node;
  mine.peer = theirs.node;
  mine.fresh = fresh_nonce();
  std::vector<std::byte> transcript;
  append(transcript, &theirs, sizeof theirs);
  append(transcript, &mine, sizeof mine);
  co_await asio::async_write(s, asio::buffer(&mine, sizeof mine), on);
  if (ec) co_return read_failed(expires);
  auto answered = co_await answer(s, transcript, from, expires, theirs.node);
  co_return answered;
}

asio::awaitable<std::optional<admission_refusal>> admission_listener::answer(
    tcp::socket& s, std::vector<std::byte>& transcript, const std::string& from,
    clock::time_point expires, std::uint32_t dialler) {
  std::error_code ec;
  auto on = asio::redirect_error(asio::use_awaitable, ec);
  admission_head h{};
  co_await asio::async_read(s, asio::buffer(&h, sizeof h), on);
  if (ec) co_return read_failed(expires);
  const auto body_bytes = request_body_bytes(h);
  if (!body_bytes.ok() || h.node != dialler) co_return admission_refusal::malformed;
  std::vector<std::byte> body(*body_bytes);
  co_await asio::async_read(s, asio::buffer(body), on);
  if (ec) co_return read_failed(expires);
  take_in(transcript, h, body);
  const bool proven = same_proof(proof_of(body), prove(settings_.token, request_label, transcript));
  append(transcript, proof_of(body).data(), proof_bytes);
  if (!proven) {
    // Told, so that a process of another job stops dialling; the reply proves nothing.
    auto refusal =
        encode(admission_reply{settings_.node, admission_verdict::wrong_token, {}, {}, 0});
    refusal.resize(refusal.size() + proof_bytes);
    co_await asio::async_write(s, asio::buffer(refusal), on);
    co_return admission_refusal::wrong_token;
  }
  if (closed_) co_return std::nullopt;
  auto reply = encode(decide_(decode_request(h, body), from));
  append(transcript, reply.data(), reply.size());
  seal(reply, transcript, settings_.token, reply_label);
  co_await asio::async_write(s, asio::buffer(reply), on);
  co_return std::nullopt;
}

// ---- dialling -------------------------------------------------------------------------------

void admission_dialing::give_up() {
  given_up = true;
  resolver.cancel();
  std::error_code ignored;
  socket.close(ignored);
}

std::shared_ptr<admission_dialing> admission_dial(
    asio::io_context& io, std::uint32_t peer, std::string host, std::uint16_t port,
    std::string token, const admission_request& request, std::chrono::milliseconds deadline,
    std::function<void(result<admission_reply>)> done) {
  auto d = std::make_shared<admission_dialing>(io);
  asio::co_spawn(io,
                 dial_exchange(d, peer, std::move(host), port, std::move(token), request, deadline,
                               std::move(done)),
                 asio::detached);
  return d;
}

}  // namespace moevement::transport::detail
