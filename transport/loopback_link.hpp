// loopback_link: an in-process `link` for tests. A loopback_hub joins several links on one
// io_context; each link is one simulated node. Envelopes really go through the wire form
// (to_words() on the sender, incoming_envelope::decode() on the receiver) and every delivery
// is posted, never run inline from send(), exactly like a real transport.
//
// The hub can simulate the three ways a peer goes away:
//   crash(n)   n's link dies; every other link reports on_peer_lost(n, crash).
//   hang(n)    nothing to or from n is delivered any more and nothing is reported (what a
//              SIGSTOPped process looks like to UCX); heartbeats must find it.
//   goodbye    n's link says_goodbye(): the others report on_peer_lost(n, goodbye).
// and two ways the network between live nodes fails:
//   cut(a, b)          nothing between a and b is delivered, nothing reported (a blackhole),
//                      until heal(a, b).
//   drop_connection    a's and b's links each report on_peer_lost(crash) of the other (an
//                      endpoint error); both processes live on (revive() redials).
// Threading: single-threaded, like every link; all calls on the io_context's thread.
#pragma once

#include <asio/io_context.hpp>

#include <cstddef>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <vector>

#include "transport/link.hpp"

namespace moevement::transport {

class loopback_link;

class loopback_hub {
 public:
  explicit loopback_hub(asio::io_context& io) : io_(io) {}
  loopback_hub(const loopback_hub&) = delete;
  loopback_hub& operator=(const loopback_hub&) = delete;
  ~loopback_hub();

  // A new simulated node. Throws if the id is taken. The link must not outlive the hub.
  std::unique_ptr<loopback_link> attach(node_id id);

  // The node's process dies: its link stops working and every other link reports
  // on_peer_lost(id, crash), once.
  void crash(node_id id);
  // The node stops responding: messages to and from it are dropped silently.
  void hang(node_id id);
  void cut(node_id a, node_id b);
  void heal(node_id a, node_id b);
  void drop_connection(node_id a, node_id b);
  // Hands a raw byte string to `to` as if `from` had sent it (malformed-input tests).
  void inject(node_id from, node_id to, std::span<const std::byte> bytes);

  asio::io_context& io() { return io_; }

 private:
  friend class loopback_link;
  void detach(node_id id);
  void deliver(node_id from, node_id to, std::shared_ptr<kj::Array<capnp::word>> words,
               std::size_t bytes);
  void report_lost(node_id at, node_id peer, peer_loss why, const std::string& detail);

  asio::io_context& io_;
  std::map<node_id, loopback_link*> links_;
  std::set<node_id> hung_;
  std::set<node_id> crashed_;
  std::set<std::pair<node_id, node_id>> cut_;  // (low, high)
  // Lets posted deliveries see that the hub is gone (links never outlive it, but posted
  // handlers can).
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

class loopback_link final : public link {
 public:
  ~loopback_link() override;

  node_id self() const override { return self_; }
  void set_handlers(link_handlers handlers) override { handlers_ = std::move(handlers); }
  result<void> send(node_id to, kj::Array<capnp::word> message) override;
  void forget(node_id peer) override;
  void revive(node_id peer) override;
  void say_goodbye() override;
  link_stats stats() const override { return stats_; }

 private:
  friend class loopback_hub;
  loopback_link(loopback_hub& hub, node_id self) : hub_(hub), self_(self) {}

  loopback_hub& hub_;
  node_id self_;
  link_handlers handlers_;
  link_stats stats_;
  bool dead_ = false;           // crashed or said goodbye: sends fail, nothing arrives
  std::set<node_id> lost_;      // peers lost or forgotten: sends fail, nothing arrives
  std::set<node_id> reported_;  // peers already reported through on_peer_lost (once each)
};

}  // namespace moevement::transport
