// The standby head's part of head_session (cluster.standby_head): starting the standby, waiting
// as one, taking over, and a head that left the job to it (docs/recovery.md "Head failover").
#include <sys/wait.h>

#include <cerrno>
#include <csignal>

#include "engine/run_log_reader.hpp"
#include "launcher/head_session.hpp"

namespace moevement::launcher {
namespace {

// A SIGUSR1 that reached a head waiting for its standby (wait_for_standby), to pass on. (A
// signal handler's flag: the one state a handler may touch.)
volatile std::sig_atomic_t usr1_to_pass_on = 0;
extern "C" void note_usr1(int) {
  usr1_to_pass_on = 1;
}

}  // namespace

void head_session::start_standby(const std::string& head) {
  try {
    auto args = standby_args(head);
    if (!lock_fds_.empty()) args.insert(args.end(), {"--locks", std::to_string(lock_fds_.size())});
    processes_.start(self_, args, transport::node_id(engine::standby_node(job_)), true, lock_fds_);
  } catch (const std::exception& e) {
    fail(std::string("cannot start the standby head: ") + e.what());
  }
}

asio::awaitable<void> head_session::wait_as_standby() {
  sys_.on_membership(
      [this](transport::node_id n, actors::member_event e) { standby_membership(n, e); });
  auto agent = sys_.spawn<standby_agent>(
      link_, [this](int status, const std::string& why) { end_standby(status, why); });
  auto coord =
      co_await sys_.whereis_global(engine::coordinator::registered_name, std::chrono::seconds(30));
  if (!coord.ok() || !coord->valid()) {
    end_standby(1, "cannot find the coordinator at the head: " +
                       (coord.ok() ? std::string("not registered") : coord.err().message));
    co_return;
  }
  if (auto* a = sys_.local_actor<standby_agent>(agent)) a->say_hello(*coord, job_.host);
}

void head_session::standby_membership(transport::node_id n, actors::member_event e) {
  if (e == actors::member_event::head_changed && n == sys_.node()) {
    take_over();
  } else if (e == actors::member_event::goodbye && n == sys_.head()) {
    end_standby(0, "the head left (the job ended)");
  } else if (e == actors::member_event::lost && n == sys_.head() && !took_over_) {
    end_standby(1, "the head was lost before this standby joined its cluster");
  } else if (n == sys_.node() && e == actors::member_event::lost) {
    const std::string why = sys_.why_lost(n);  // its own verdict (cut off), or the head's
    end_standby(1, why.starts_with("this standby") ? why : "the head declared this standby lost");
  }
}

void head_session::take_over() {
  if (took_over_ || standby_status_) return;
  // Every worker left before the head went (the job ended under it, its Shutdown never came
  // here): nothing to take over, and nothing to write in the run log.
  if (sys_.members().empty()) {
    end_standby(0, "the head was lost after every worker had left: nothing to take over");
    return;
  }
  journal_.emplace(job_);
  std::vector<std::string> rejected;
  auto point = journal_->load(&rejected);
  for (const auto& r : rejected) say("moevement launch (standby head): " + r);
  if (!point.ok()) {
    const std::string why =
        rejected.empty() && journal_->empty()
            ? "the head was lost before the job's first durable window reached the disk: "
              "nothing to take over from; run the job again"
            : "the head was lost and this standby cannot take over: " + point.err().message;
    log_.write(engine::json_record{}
                   .add("kind", "event")
                   .add("event", "job_failed")
                   .add("message", why)
                   .add("time_s", log_.seconds()));
    end_standby(1, why);
    return;
  }
  took_over_ = true;
  take_locks();
  log_.start_on_new_line();  // the lost head may have died mid-record
  std::set<transport::node_id> alive;
  for (const auto& m : sys_.members()) alive.insert(m.node);
  say(fmt::format(
      "moevement launch (standby head, pid {}): the head was lost ({}); taking over with {} "
      "workers (the journal's newest window on disk: {}, iteration {})",
      ::getpid(), sys_.why_lost(sys_.config().head), alive.size(), point->window,
      point->target_iteration));
  make_callbacks();
  coord_ = sys_.spawn<engine::coordinator>(job_, options_.raw, cb_, &log_,
                                           recovery::any_head_recovery(job_.policy),
                                           std::move(*point), std::move(alive));
  arm_start_timeout();  // every worker says hello again within cluster.start_timeout_ms
  asio::co_spawn(
      io_,
      [this]() -> asio::awaitable<void> {
        auto r = co_await sys_.register_global(engine::coordinator::registered_name, coord_,
                                               std::chrono::seconds(5));
        if (!r.ok()) fail("cannot register the coordinator: " + r.err().message);
      },
      asio::detached);
}

void head_session::take_locks() {
  // The lost head's: a hung one holds them until it wakes up and leaves (replaced()), so they
  // are tried again every second until this head holds them all.
  // (Unless it was started holding them: job_lock::fds.)
  if (lock_.fds().empty() || !lock_.holds_all()) {
    // Let go of what it holds first: flock refuses a second descriptor of this same process
    // the lock it holds, so a retry holding one lock took only the other, and swapped them.
    lock_ = job_lock{};
    lock_ = job_lock::try_take(job_, true);
  }
  if (lock_.holds_all() || finished_) return;
  relock_.expires_after(std::chrono::seconds(1));
  relock_.async_wait([this](const std::error_code& ec) {
    if (!ec) take_locks();
  });
}

void head_session::end_standby(int status, const std::string& why) {
  if (standby_status_ || took_over_) return;
  standby_status_ = status;
  if (status != 0) {
    std::cerr << fmt::format("moevement launch (standby head, pid {}): {}\n", ::getpid(), why);
  }
  sys_.shutdown();
  linger_.expires_after(std::chrono::milliseconds(100));
  linger_.async_wait([this](const std::error_code&) { io_.stop(); });
}

void head_session::replaced() {
  if (replaced_) return;
  replaced_ = true;
  finished_ = true;
  // Its journal writes still queued would go over the standby's (a window number it reuses,
  // a drop of the newer ones): none is written from now on.
  journal_fenced_ = true;
  // Its own reason (it stalled, or it is the one cut off), or the standby's verdict on it.
  const std::string why = sys_.why_lost(sys_.node());
  say("moevement launch: " +
      (why.starts_with("this head")
           ? why
           : fmt::format("the standby head took this head's place ({}): leaving the job to it",
                         why.empty() ? "fenced" : why)));
  // The standby, where it is this process's child, is waited for (run()): the launch ends with
  // the job's status, not this head's.
  standby_child_ = processes_.pid_of(transport::node_id(engine::standby_node(job_)));
  processes_.forget_all();
  if (step_) step_->release();  // the workers' step is the standby's now
  if (standby_step_) standby_step_->release();
  injector_.stop();
  io_.stop();
}

int head_session::wait_for_standby() {
  if (!standby_child_) return 1;
  say(fmt::format("moevement launch: waiting for the standby head (pid {}) to end the job",
                  *standby_child_));
  // Ctrl-C or SIGTERM now end this process alone (the standby goes on, as its own launch);
  // SIGUSR1, a stop at the next window on disk, is the standby's to act on now: passed on.
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  std::signal(SIGUSR1, note_usr1);
  int status = 0;
  pid_t waited = -1;
  while ((waited = ::waitpid(*standby_child_, &status, WNOHANG)) == 0 ||
         (waited < 0 && errno == EINTR)) {
    if (usr1_to_pass_on != 0) {
      usr1_to_pass_on = 0;
      ::kill(*standby_child_, SIGUSR1);
      say(fmt::format("moevement launch: SIGUSR1 passed on to the standby head (pid {})",
                      *standby_child_));
    }
    ::usleep(50'000);
  }
  const int code = waited < 0            ? 1  // (reaped already: its status is gone)
                   : WIFEXITED(status)   ? WEXITSTATUS(status)
                   : WIFSIGNALED(status) ? 128 + WTERMSIG(status)
                                         : 1;
  // A standby that ended without ending the job (it was cut off too, or found no majority):
  // the run log would end with neither, and nothing would say how to go on.
  if (!engine::run_log_ended(job_.run_log)) {
    // (It may have taken the job over and died before its end: killed, or out of memory.)
    const std::string why = fmt::format(
        "the head left the job to its standby head, which ended (status {}) {}{}", code,
        engine::run_log_taken_over(job_.run_log)
            ? "after it took the job over, before the job's end"
            : "without taking it over",
        journal_ ? ": `moevement launch CONFIG --resume` goes on from the newest window on disk"
                 : "");
    log_.start_on_new_line();
    log_.write(engine::json_record{}
                   .add("kind", "event")
                   .add("event", "job_failed")
                   .add("message", why)
                   .add("time_s", log_.seconds()));
    std::cerr << "moevement launch: " << why << "\n";
    return code == 0 ? 1 : code;
  }
  return code;
}

}  // namespace moevement::launcher
