#include "transport/loopback_link.hpp"

#include <fmt/format.h>
#include <asio/post.hpp>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace moevement::transport {

loopback_hub::~loopback_hub() {
  *alive_ = false;
}

std::unique_ptr<loopback_link> loopback_hub::attach(node_id id) {
  if (links_.contains(id)) {
    throw std::invalid_argument(
        fmt::format("loopback_hub: node {} is already attached; give each link its own id", id));
  }
  auto l = std::unique_ptr<loopback_link>(new loopback_link(*this, id));
  links_[id] = l.get();
  return l;
}

void loopback_hub::detach(node_id id) {
  links_.erase(id);
}

void loopback_hub::crash(node_id id) {
  auto it = links_.find(id);
  if (it == links_.end() || it->second->dead_) return;
  it->second->dead_ = true;
  crashed_.insert(id);
  for (auto& [other, l] : links_) {
    if (other != id) report_lost(other, id, peer_loss::crash, "simulated crash");
  }
}

void loopback_hub::hang(node_id id) {
  hung_.insert(id);
}

void loopback_hub::cut(node_id a, node_id b) {
  cut_.insert(std::minmax(a, b));
}

void loopback_hub::heal(node_id a, node_id b) {
  cut_.erase(std::minmax(a, b));
}

void loopback_hub::drop_connection(node_id a, node_id b) {
  report_lost(a, b, peer_loss::crash, "simulated endpoint error");
  report_lost(b, a, peer_loss::crash, "simulated endpoint error");
}

void loopback_hub::report_lost(node_id at, node_id peer, peer_loss why, const std::string& detail) {
  asio::post(io_, [this, alive = alive_, at, peer, why, detail] {
    if (!*alive) return;
    auto it = links_.find(at);
    if (it == links_.end() || it->second->dead_) return;
    loopback_link& l = *it->second;
    l.lost_.insert(peer);
    if (!l.reported_.insert(peer).second) return;  // once per peer
    if (l.handlers_.on_peer_lost) l.handlers_.on_peer_lost(peer, why, detail);
  });
}

void loopback_hub::deliver(node_id from, node_id to, std::shared_ptr<kj::Array<capnp::word>> words,
                           std::size_t bytes) {
  asio::post(io_, [this, alive = alive_, from, to, words = std::move(words), bytes] {
    if (!*alive) return;
    if (hung_.contains(from) || hung_.contains(to)) return;  // a hung process says nothing
    if (cut_.contains(std::minmax(from, to))) return;
    auto it = links_.find(to);
    if (it == links_.end() || it->second->dead_) return;
    loopback_link& l = *it->second;
    if (l.lost_.contains(from)) return;  // forgotten peers are not heard any more
    auto span = std::as_bytes(std::span(words->begin(), words->size())).first(bytes);
    auto env = incoming_envelope::decode(span);
    if (!env.ok()) {
      ++l.stats_.malformed;
      return;
    }
    ++l.stats_.received;
    // The envelope reads in place from `words`, which this handler keeps alive for the call.
    if (l.handlers_.on_message) l.handlers_.on_message(from, std::move(*env));
  });
}

void loopback_hub::inject(node_id from, node_id to, std::span<const std::byte> bytes) {
  auto words =
      std::make_shared<kj::Array<capnp::word>>(kj::heapArray<capnp::word>((bytes.size() + 7) / 8));
  if (!bytes.empty()) {
    std::memset(static_cast<void*>(words->begin()), 0, words->size() * sizeof(capnp::word));
    std::memcpy(static_cast<void*>(words->begin()), bytes.data(), bytes.size());
  }
  deliver(from, to, std::move(words), bytes.size());
}

loopback_link::~loopback_link() {
  hub_.detach(self_);
}

result<void> loopback_link::send(node_id to, kj::Array<capnp::word> message) {
  if (dead_) {
    ++stats_.send_errors;
    return error{
        fmt::format("loopback link {} is closed; no sends after a crash or goodbye", self_)};
  }
  auto peer = hub_.links_.find(to);
  if (peer == hub_.links_.end() || peer->second->dead_ || lost_.contains(to) || to == self_) {
    ++stats_.send_errors;
    return error{fmt::format("node {} is unknown or lost to node {}", to, self_)};
  }
  ++stats_.sent;
  if (hub_.hung_.contains(self_)) return {};  // a hung process sends nothing
  const std::size_t bytes = message.size() * sizeof(capnp::word);
  auto words = std::make_shared<kj::Array<capnp::word>>(std::move(message));
  hub_.deliver(self_, to, std::move(words), bytes);
  return {};
}

void loopback_link::forget(node_id peer) {
  if (peer == self_) return;
  lost_.insert(peer);  // sends fail from now on; the report follows, posted
  hub_.report_lost(self_, peer, peer_loss::crash, "forgotten (heartbeat timeout)");
}

void loopback_link::revive(node_id peer) {
  lost_.erase(peer);
  reported_.erase(peer);
  // The dial a revive leads to: a crashed process refuses it (as a closed port answers a SYN).
  auto it = hub_.links_.find(peer);
  if (it == hub_.links_.end() || it->second->dead_) {
    lost_.insert(peer);
    hub_.report_lost(self_, peer, peer_loss::refused,
                     "simulated refused dial (the process is gone)");
  }
}

void loopback_link::say_goodbye() {
  if (dead_) return;
  for (auto& [other, l] : hub_.links_) {
    if (other != self_) hub_.report_lost(other, self_, peer_loss::goodbye, "goodbye");
  }
  dead_ = true;
}

}  // namespace moevement::transport
