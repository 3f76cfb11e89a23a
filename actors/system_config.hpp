// The actor system's tunables (system_config, each with its one default) and its counters
// (system_stats); actors/system.hpp is the system itself.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "actors/time_source.hpp"
#include "transport/link.hpp"

namespace moevement::actors {

using transport::node_id;

// Every tunable of the actor system, with its one default.
struct system_config {
  std::uint32_t incarnation = 1;  // bump on every restart of this node
  node_id head = 0;               // holds membership and the cluster-wide registry
  // The node that becomes the head when the head is lost (none: a lost head is the end). Set
  // on the head (members learn it when they join) and on the standby itself. On the standby,
  // the head's loss (its transport's notice, or its heartbeats' silence) is the verdict: it
  // takes the head's place, tells every member (MemberLost of the old head, which is fenced),
  // and the members register their cluster-wide names with it again.
  std::optional<node_id> standby = std::nullopt;
  // Mailbox bound per actor (user messages; down/exit notifications are never refused).
  // When full, a send fails at once: local tell/ask return an error to the sender, a remote
  // ask gets an error reply, a remote tell is dropped and counted (stats().mailbox_full).
  std::size_t mailbox_capacity = 4096;
  // Failure detection: every member gets a heartbeat each interval. Only the head declares a
  // member lost: one it has not heard from (any message counts) for `heartbeat_timeout`, one
  // whose process its transport saw end, or one another member reports silent for that long
  // (after `suspicion_window`; actors/suspicions.hpp). Other members report, reconnect and
  // go on; the head's verdict reaches them as a message. A hung node is detected after
  // timeout .. timeout + interval.
  std::chrono::milliseconds heartbeat_interval{100};
  std::chrono::milliseconds heartbeat_timeout{1000};
  // A member never heard from since it joined is given this long instead (when longer): its
  // first messages wait for a connection, and a dropped SYN alone costs Linux 1 s, two in a
  // row 3 s, three 7 s. A process that dies is found by the transport at once anyway.
  std::chrono::milliseconds join_grace{10000};
  // How long the head collects members' reports of a silent peer before its verdict: every
  // report of one fault (a node cut off from all its peers reports them all in one tick).
  std::chrono::milliseconds suspicion_window{200};
  // A member whose report alone cost another member its place is the one judged, not the
  // peer, when it reports another within this long (a link of its own that flaps).
  std::chrono::milliseconds suspicion_memory{60000};
  // Where the system reads the time and sets its timers; null: the steady clock (production).
  // Tests give a manual_time (actors/deterministic.hpp). Not owned; must outlive the system.
  time_source* time = nullptr;
};

struct system_stats {
  std::uint64_t malformed = 0;     // wire messages refused (bad payload, unknown type)
  std::uint64_t mailbox_full = 0;  // sends refused because the target's mailbox was full
  std::uint64_t dead_letters = 0;  // tells to actors that were gone (remote side)
  std::uint64_t expired = 0;       // asks dropped unhandled because the caller gave up
  std::uint64_t late_replies = 0;  // replies that arrived after their ask ended
  std::uint64_t reconnects = 0;    // connections to a live member that failed and were redialled
  std::uint64_t suspicions = 0;    // members reported to the head as silent (non-head nodes)
  std::uint64_t verdicts = 0;      // members the head declared lost on others' reports
  std::uint64_t fenced = 0;        // messages dropped from a node declared lost
  // Messages dropped because they spoke for another node than the one they came from (a
  // sender, a reply to an ask made elsewhere, a Down or Unregister of another node's actor).
  std::uint64_t wrong_sender = 0;
};

}  // namespace moevement::actors
