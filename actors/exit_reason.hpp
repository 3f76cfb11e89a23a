// Why an actor stopped, as monitors (down messages) and links (exit signals) report it.
#pragma once

#include <cstdint>
#include <string>

namespace moevement::actors {

enum class exit_kind : std::uint8_t {
  normal = 0,     // the actor finished its work (quit()); links do not propagate it
  shutdown = 1,   // stopped by its supervisor or the system; not a failure
  error = 2,      // a handler threw, or a linked actor failed
  killed = 3,     // reserved: nothing stops an actor so (a value of the wire format kept)
  noproc = 4,     // the target did not exist when it was monitored or linked
  node_lost = 5,  // the actor's node crashed or hung (heartbeat timeout)
};

struct exit_reason {
  exit_kind kind = exit_kind::normal;
  std::string detail;

  // OTP's rule: only normal and shutdown exits are not failures.
  bool abnormal() const { return kind != exit_kind::normal && kind != exit_kind::shutdown; }
  std::string to_string() const;

  static exit_reason normal() { return {exit_kind::normal, {}}; }
  static exit_reason shutdown(std::string d = {}) { return {exit_kind::shutdown, std::move(d)}; }
  static exit_reason failure(std::string d) { return {exit_kind::error, std::move(d)}; }
};

}  // namespace moevement::actors
