#include "transport/delivery_book.hpp"

#include <algorithm>

namespace moevement::transport {

delivery_book::header delivery_book::stamp(node_id peer, words message) {
  stream& s = streams_[peer];
  if (s.unacked.empty()) s.progress_at = {};  // its wait for an ack starts now
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
  s.owe_ack = false;
  s.owed_since = {};
  const std::uint64_t oldest = s.unacked.empty() ? seq : std::min(seq, s.unacked.front().seq);
  return {session_, seq, s.peer_session, s.delivered, oldest};
}

std::vector<delivery_book::stamped> delivery_book::unacked(node_id peer) const {
  auto it = streams_.find(peer);
  if (it == streams_.end()) return {};
  return {it->second.unacked.begin(), it->second.unacked.end()};
}

bool delivery_book::resend_requested(node_id peer, const header& h, clock::time_point now) {
  auto it = streams_.find(peer);
  if (it == streams_.end() || h.ack_session != session_) return false;  // another life's
  stream& s = it->second;
  drop_acked(s, h.ack_session, h.ack_seq);
  s.progress_at = now;
  if (s.unacked.empty()) return false;
  // Answered again only once the receiver got further, or resend_after later (its own pace
  // for asking again): a peer repeating one request made each copy resend everything kept.
  const bool further = s.answered_at == clock::time_point{} || h.ack_seq > s.answered_ack;
  if (!further && now - s.answered_at < timing_.resend_after) return false;
  s.answered_ack = h.ack_seq;
  s.answered_at = now;
  return true;
}

std::vector<std::pair<node_id, delivery_book::stamped>> delivery_book::probes_due(
    clock::time_point now) {
  std::vector<std::pair<node_id, stamped>> due;
  for (auto& [peer, s] : streams_) {
    if (s.unacked.empty()) continue;
    if (s.progress_at == clock::time_point{}) {
      s.progress_at = now;
    } else if (now - s.progress_at >=
               timing_.resend_after * (1u << std::min(s.probes, max_backoff))) {
      s.progress_at = now;
      ++s.probes;
      due.emplace_back(peer, s.unacked.front());
    }
  }
  return due;
}

void delivery_book::owe(stream& s, clock::time_point now) {
  if (s.owed_since == clock::time_point{}) s.owed_since = now;
}

delivery_book::verdict delivery_book::accept(node_id peer, const header& h, clock::time_point now) {
  stream& s = streams_[peer];
  const std::uint64_t oldest =
      std::clamp<std::uint64_t>(h.oldest, 1, std::max<std::uint64_t>(h.seq, 1));
  if (h.session != s.peer_session) {
    // A new process on that node (or the first message): its stream starts at the oldest
    // message it keeps. (What we kept for the one before stays: some of it went to this one,
    // and a process's acks drain it; the actor layer drops what was for another incarnation.)
    s.peer_session = h.session;
    s.delivered = oldest - 1;
    s.acked_back = s.delivered;
    s.owe_ack = false;
    s.owed_since = {};
    s.asked_from = 0;
    s.seen = 0;
    s.new_hole = false;
  }
  drop_acked(s, h.ack_session, h.ack_seq);
  s.seen = std::max(s.seen, h.seq);
  if (h.seq <= s.delivered) {
    ++duplicates_;
    s.owe_ack = true;  // a probe, or a resend overtaken: say where we are
    owe(s, now);
    return verdict::duplicate;
  }
  if (oldest > s.delivered + 1) {
    // The sender no longer keeps the ones between (past max_unacked, or it forgot us): they
    // are lost for good, counted; the stream goes on from what it keeps.
    gaps_ += oldest - s.delivered - 1;
    s.delivered = oldest - 1;
  }
  if (h.seq != s.delivered + 1) {
    ++early_;
    if (s.asked_from != 0 && s.delivered + 1 > s.asked_from) s.new_hole = true;
    return verdict::early;
  }
  s.delivered = h.seq;
  s.delivered_at = now;
  if (s.delivered >= s.seen) s.asked_from = 0;  // whole again
  owe(s, now);
  return verdict::deliver;
}

std::optional<delivery_book::header> delivery_book::resend_request(node_id peer,
                                                                   clock::time_point now) {
  stream& s = streams_[peer];
  const std::uint64_t from = s.delivered + 1;
  if (s.seen < from) return std::nullopt;  // nothing missing that we know of
  const bool stalled = now - std::max(s.asked_at, s.delivered_at) >= timing_.resend_after;
  if (s.asked_from != 0 && !s.new_hole && !stalled) return std::nullopt;
  s.asked_from = from;
  s.asked_at = now;
  s.new_hole = false;
  return ack_header(peer);
}

std::vector<std::pair<node_id, delivery_book::header>> delivery_book::resend_requests_due(
    clock::time_point now) {
  std::vector<std::pair<node_id, header>> due;
  for (auto& [peer, s] : streams_) {
    if (s.seen <= s.delivered) continue;
    if (auto h = resend_request(peer, now)) due.emplace_back(peer, *h);
  }
  return due;
}

void delivery_book::acked(node_id peer, std::uint64_t session, std::uint64_t seq) {
  auto it = streams_.find(peer);
  if (it != streams_.end()) drop_acked(it->second, session, seq);
}

void delivery_book::drop_acked(stream& s, std::uint64_t session, std::uint64_t seq) {
  if (session != session_) return;  // an ack of another life of this link
  bool progress = false;
  while (!s.unacked.empty() && s.unacked.front().seq <= seq) {
    s.unacked.pop_front();
    progress = true;
  }
  if (progress) {
    s.progress_at = {};
    s.probes = 0;
  }
}

bool delivery_book::ack_due(node_id peer, clock::time_point now) const {
  auto it = streams_.find(peer);
  if (it == streams_.end()) return false;
  const stream& s = it->second;
  if (s.delivered - s.acked_back >= ack_every) return true;
  return (s.delivered > s.acked_back || s.owe_ack) && s.owed_since != clock::time_point{} &&
         now - s.owed_since >= timing_.ack_delay;
}

std::vector<node_id> delivery_book::acks_due(clock::time_point now) const {
  std::vector<node_id> due;
  for (const auto& [peer, s] : streams_) {
    if (ack_due(peer, now)) due.push_back(peer);
  }
  return due;
}

delivery_book::header delivery_book::ack_header(node_id peer) {
  stream& s = streams_[peer];
  s.acked_back = s.delivered;
  s.owe_ack = false;
  s.owed_since = {};
  return {session_, 0, s.peer_session, s.delivered, 0};
}

delivery_book::header delivery_book::goodbye_header(node_id peer) {
  stream& s = streams_[peer];
  header h = ack_header(peer);
  h.seq = s.next_seq - 1;  // 0: nothing was ever numbered for it
  h.oldest = s.unacked.empty() ? s.next_seq : s.unacked.front().seq;
  return h;
}

std::uint64_t delivery_book::missing_before_goodbye(node_id peer, const header& h) {
  stream& s = streams_[peer];
  if (h.oldest == 0 || h.seq < h.oldest) return 0;  // it keeps nothing for us
  // Not heard from that session yet (its first messages may be on another connection, or the
  // goodbye came first): all it keeps is still to come.
  if (h.session != s.peer_session) return h.seq - h.oldest + 1;
  const std::uint64_t from = std::max(s.delivered + 1, h.oldest);
  if (h.seq < from) return 0;
  s.seen = std::max(s.seen, h.seq);
  return h.seq - from + 1;
}

std::uint64_t delivery_book::peer_session(node_id peer) const {
  auto it = streams_.find(peer);
  return it == streams_.end() ? 0 : it->second.peer_session;
}

std::size_t delivery_book::kept() const {
  std::size_t n = 0;
  for (const auto& [peer, s] : streams_) n += s.unacked.size();
  return n;
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
