// Who holds the head's place when a link, not a process, fails (config.standby set). Each side
// of a cut sees the other go silent; without a quorum both would go on as the head (two run
// logs interleaved, each ending the other's workers). The nodes other than the head (the
// standby and the workers) vote, and each side needs a strict majority of them:
//   - the head yields (judges nobody, reports itself lost, falls silent, says no goodbye) once
//     a majority of them, two at least, have been silent past half the timeout: it is the one
//     cut off;
//   - a member that no longer hears the head (silence, or a refused redial: its process gone)
//     tells the standby (Unreachable of the head), and takes it back when it hears the head
//     again (Reachable); on silence it does not follow the standby on its own;
//   - the standby takes the head's place once it does not hear the head itself, every member
//     it still hears has said so, and those members and the standby are a majority. A standby
//     that hears no member either is the one cut off and leaves.
// The price: where over half of them fail silently at once (a rack with the standby in it),
// no side holds a majority and the job ends (`--resume` goes on).
#include <fmt/format.h>

#include "actors/system.hpp"

namespace moevement::actors {

bool actor_system::head_cut_off(std::size_t newly_silent) {
  if (yielded_) return true;
  if (node_ != head_ || !standby_ || !members_.contains(*standby_) || newly_silent == 0) {
    return false;
  }
  // Those past half the timeout count too: a cut silences every member at once, but their
  // last heartbeats came up to an interval apart, and one declared lost a tick before the
  // others would be ended by its launcher. Members never heard yet (in their join grace: a
  // dropped SYN costs a second) count neither way.
  const auto now = this->now();
  std::size_t quiet = 0, heard = 0;
  for (const auto& [n, m] : members_) {
    if (!m.heard) continue;
    ++heard;
    quiet += now - m.last_heard > config_.heartbeat_timeout / 2;
  }
  // (Two at least: the standby alone hung, before the workers joined, is no cut.)
  if (quiet < 2 || 2 * quiet <= heard) return false;
  yielded_ = true;
  lost_why_[node_] = fmt::format(
      "this head has not heard {} of its {} members for over {} ms: it is the one cut off, and "
      "leaves the job to the standby head",
      quiet, heard, config_.heartbeat_timeout.count() / 2);
  if (membership_fn_) membership_fn_(node_, member_event::lost);
  return true;
}

void actor_system::head_silent() {
  const std::string why = fmt::format("no heartbeat for {} ms", config_.heartbeat_timeout.count());
  if (!standby_) {
    declare_lost(head_, false, why);
    return;
  }
  if (is_standby()) {
    if (head_loss_.empty()) head_loss_ = why;
    maybe_take_over();
    return;
  }
  // A standby this member does not hear either cannot take over for it: the head is lost.
  const auto s = members_.find(*standby_);
  if (s == members_.end() || s->second.suspected) {
    standby_.reset();
    declare_lost(head_, false, why);
    return;
  }
  report_head(true);
}

void actor_system::head_still_silent() {
  if (is_standby()) {
    maybe_take_over();
    return;
  }
  if (!standby_) {  // the standby left meanwhile (its goodbye): nobody takes over
    head_silent();
    return;
  }
  // No takeover came within three timeouts (the standby's side is no majority, or this member
  // is cut off from the rest): the head is lost here, and this member stops.
  if (const auto h = members_.find(head_);
      h != members_.end() && now() - h->second.last_heard > 3 * config_.heartbeat_timeout) {
    standby_.reset();
    head_silent();
    return;
  }
  const auto s = members_.find(*standby_);
  if (s == members_.end() || s->second.suspected) head_silent();
}

void actor_system::report_head(bool unreachable) {
  if (!standby_ || is_standby()) return;
  const auto h = members_.find(head_);
  if (h == members_.end()) return;
  const std::uint64_t type =
      unreachable ? capnp::typeId<proto::Unreachable>() : capnp::typeId<proto::Reachable>();
  transport::outgoing_envelope out({{}, {*standby_, 0, 0}, type, 0, 0});
  if (unreachable) {
    auto who = out.init_payload<proto::Unreachable>().initMember();
    who.setNode(head_);
    who.setIncarnation(h->second.incarnation);
  } else {
    auto who = out.init_payload<proto::Reachable>().initMember();
    who.setNode(head_);
    who.setIncarnation(h->second.incarnation);
  }
  (void)send_envelope(*standby_, out);
}

void actor_system::maybe_take_over() {
  if (!is_standby() || shut_down_) return;
  const auto h = members_.find(head_);
  if (h == members_.end() || !h->second.suspected) return;
  std::size_t heard = 0, others = 0, say_so = 0;
  for (const auto& [n, m] : members_) {
    if (n == head_) continue;
    ++others;
    if (m.suspected) continue;
    ++heard;
    say_so += head_unheard_.contains(n);
  }
  const bool alone = others > 0 && heard == 0;  // this standby is the one cut off
  if (alone || now() - h->second.last_heard > 3 * config_.heartbeat_timeout) {
    lost_why_[node_] =
        alone ? "this standby hears neither the head nor any member: it is the one cut off, and "
                "leaves"
              : "this standby found no majority to take the head's place within three failure "
                "timeouts (the head goes on where it holds one): it leaves";
    standby_.reset();
    if (membership_fn_) membership_fn_(node_, member_event::lost);
    return;
  }
  // A member still hears the head: it lives, only this link is cut. And the side that takes
  // over must be a majority of the voters (the members but the head, and this standby): the
  // head's side, where it holds one, goes on.
  if (say_so < heard || 2 * (say_so + 1) <= others + 1) return;
  declare_lost(head_, false,
               (head_loss_.empty() ? std::string("not heard") : head_loss_) +
                   "; nor does any member hear it");
}

}  // namespace moevement::actors
