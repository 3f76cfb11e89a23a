// Who holds the head's place when a link, not a process, fails (config.standby set). Each side
// of a cut sees the other go silent; without a quorum both would go on as the head (two run
// logs interleaved, each ending the other's workers). So:
//   - the head yields (judges nobody, reports itself lost, falls silent) once it hears under
//     half of its members at once: it is the one cut off;
//   - a member that no longer hears the head tells the standby (Unreachable of the head), and
//     takes it back when it hears the head again (Reachable); it does not follow the standby
//     on its own verdict;
//   - the standby takes the head's place once it no longer hears the head itself and every
//     member it still hears has said so. A standby that hears no member either is the one
//     cut off and leaves.
// A head's process that ended is seen by the transport (a refused redial), as before: that is
// a verdict on its own everywhere.
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
  // others would be ended by its launcher.
  const auto now = this->now();
  std::size_t quiet = 0;
  for (const auto& [n, m] : members_) quiet += now - m.last_heard > config_.heartbeat_timeout / 2;
  if (2 * quiet <= members_.size()) return false;
  yielded_ = true;
  lost_why_[node_] = fmt::format(
      "this head has not heard {} of its {} members for over {} ms: it is the one cut off, and "
      "leaves the job to the standby head",
      quiet, members_.size(), config_.heartbeat_timeout.count() / 2);
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
  if (!standby_) return;
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
  std::size_t heard = 0, others = 0;
  bool all_say_so = true;
  for (const auto& [n, m] : members_) {
    if (n == head_) continue;
    ++others;
    if (m.suspected) continue;
    ++heard;
    all_say_so = all_say_so && head_unheard_.contains(n);
  }
  if (others > 0 && heard == 0) {  // this standby is the one cut off
    lost_why_[node_] =
        "this standby hears neither the head nor any member: it is the one cut off, and leaves";
    standby_.reset();
    if (membership_fn_) membership_fn_(node_, member_event::lost);
    return;
  }
  if (!all_say_so) return;  // a member still hears the head: it lives, only this link is cut
  declare_lost(
      head_, false,
      fmt::format("no heartbeat for {} ms, nor to any member", config_.heartbeat_timeout.count()));
}

}  // namespace moevement::actors
