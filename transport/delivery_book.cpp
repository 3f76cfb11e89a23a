#include "transport/delivery_book.hpp"

namespace moevement::transport {

delivery_book::header delivery_book::stamp(node_id peer, words message) {
  stream& s = streams_[peer];
  const std::uint64_t seq = s.next_seq++;
  s.unacked.push_back({seq, std::move(message)});
  if (s.unacked.size() > max_unacked) {
    s.unacked.pop_front();
    ++overflowed_;
  }
  return restamp(peer, seq);
}

delivery_book::header delivery_book::restamp(node_id peer, std::uint64_t seq) {
  stream& s = streams_[peer];
  s.acked_back = s.delivered;  // carried by this message
  return {session_, seq, s.peer_session, s.delivered};
}

std::vector<delivery_book::stamped> delivery_book::unacked(node_id peer) const {
  auto it = streams_.find(peer);
  if (it == streams_.end()) return {};
  return {it->second.unacked.begin(), it->second.unacked.end()};
}

bool delivery_book::accept(node_id peer, const header& h) {
  stream& s = streams_[peer];
  if (h.session != s.peer_session) {
    // A new process on that node (or the first message): its stream starts here, and what we
    // kept for the one before is for nobody now.
    if (s.peer_session != 0) s.unacked.clear();
    s.peer_session = h.session;
    s.delivered = h.seq - 1;
    s.acked_back = s.delivered;
  }
  drop_acked(s, h.ack_session, h.ack_seq);
  if (h.seq <= s.delivered) {
    ++duplicates_;
    return false;
  }
  if (h.seq != s.delivered + 1) ++gaps_;  // only past max_unacked or after a forget
  s.delivered = h.seq;
  return true;
}

void delivery_book::acked(node_id peer, std::uint64_t session, std::uint64_t seq) {
  auto it = streams_.find(peer);
  if (it != streams_.end()) drop_acked(it->second, session, seq);
}

void delivery_book::drop_acked(stream& s, std::uint64_t session, std::uint64_t seq) {
  if (session != session_) return;  // an ack of another life of this link
  while (!s.unacked.empty() && s.unacked.front().seq <= seq) s.unacked.pop_front();
}

bool delivery_book::ack_due(node_id peer) const {
  auto it = streams_.find(peer);
  return it != streams_.end() && it->second.delivered - it->second.acked_back >= ack_every;
}

delivery_book::header delivery_book::ack_header(node_id peer) {
  stream& s = streams_[peer];
  s.acked_back = s.delivered;
  return {session_, 0, s.peer_session, s.delivered};
}

void delivery_book::forget(node_id peer) {
  auto it = streams_.find(peer);
  if (it == streams_.end()) return;
  // Our numbering goes on (a peer that still knows our session must not take new messages
  // for copies); everything else about it starts afresh.
  const std::uint64_t next = it->second.next_seq;
  it->second = stream{};
  it->second.next_seq = next;
}

}  // namespace moevement::transport
