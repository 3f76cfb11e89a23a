#include "launcher/injector.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <set>

namespace moevement::launcher {

injection_plan plan_injections(const std::vector<injection>& injections,
                               const engine::job_config& job, bool dry_run, std::ostream& out) {
  injection_plan plan;
  std::set<std::string> given;
  for (const auto& inj : injections) {
    // The same failure twice strikes once (or the second finds its worker gone): a mistake.
    if (!given.insert(inj.text()).second) {
      throw std::invalid_argument(fmt::format(
          "--inject {} is given twice: each injection strikes once (a second failure needs "
          "another iter=, stage= or replica=)",
          inj.text()));
    }
    const auto s = check_injection(inj, job);
    if (!s.empty()) {
      std::string line = "injection: " + inj.text() + " schedule:";
      for (const auto& f : s) line += " " + f.text() + ";";
      line.pop_back();
      out << line << "\n";
    } else if (dry_run) {
      out << "injection: " << inj.text() << "\n";
    }
    plan.schedule.insert(plan.schedule.end(), s.begin(), s.end());
    // The workers' own: phase=... kills and hangs, and flips.
    if (inj.phase || inj.what == injection::kind::flip) plan.worker_specs.push_back(inj.text());
  }
  std::stable_sort(plan.schedule.begin(), plan.schedule.end(),
                   [](const auto& a, const auto& b) { return a.at_s < b.at_s; });
  return plan;
}

failure_injector::failure_injector(asio::io_context& io, engine::run_log& log,
                                   std::vector<injection> injections, injection_plan plan,
                                   std::int64_t iterations,
                                   std::function<const worker_table*()> workers,
                                   std::function<void(const std::string&)> say)
    : io_(io),
      log_(log),
      injections_(std::move(injections)),
      schedule_(std::move(plan.schedule)),
      iterations_(iterations),
      workers_(std::move(workers)),
      say_(std::move(say)),
      self_exe_(std::filesystem::read_symlink("/proc/self/exe")),
      schedule_timer_(io) {}

// The run log's `inject` event: what the head struck, and where (phase=... injections are the
// workers' own and show as their worker_lost).
void failure_injector::log_injection(const std::string& spec, transport::node_id n, int stage,
                                     int replica) {
  log_.write(engine::json_record{}
                 .add("kind", "event")
                 .add("event", "inject")
                 .add("spec", spec)
                 .add("node", std::int64_t{n})
                 .add("stage", stage)
                 .add("replica", replica)
                 .add("time_s", log_.seconds()));
}

// A head-side injection signals pids, which mean something only on the head's host: a worker on
// another host has a pid that here may be any other process's. So only processes of this very
// program are signalled.
// A zombie its parent (the launcher) has not reaped yet: struck already. (A pid with no
// process here may be on another host: not known to have ended.)
bool failure_injector::ended(int pid) {
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  std::string text;
  if (!std::getline(stat, text)) return false;
  const auto close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() && text[close + 2] == 'Z';
}

bool failure_injector::ours(int pid) const {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink(fmt::format("/proc/{}/exe", pid), ec);
  return !ec && exe == self_exe_;
}

// Kills (or stops) the worker that holds (stage, replica) now, or every process of its failure
// domain; false if none was struck.
bool failure_injector::strike(failure_kind what, int stage, int replica, const std::string& label,
                              const std::string& note, bool whole_host) {
  const worker_table* workers = workers_();
  if (workers == nullptr || stopped_) return false;
  const auto held = std::find_if(workers->begin(), workers->end(), [&](const auto& w) {
    return w.second.stage == stage && w.second.replica == replica;
  });
  if (held == workers->end()) {
    say_(fmt::format("inject: {}: no worker holds stage {} replica {} now; skipped", label, stage,
                     replica));
    return false;
  }
  std::vector<const engine::worker_info*> victims;
  for (const auto& [n, w] : *workers) {
    if (n != held->first && !(whole_host && w.domain == held->second.domain)) continue;
    if (ours(w.pid)) {
      victims.push_back(&w);
    } else if (ended(w.pid)) {  // struck already (two injections at once), its loss not seen yet
      say_(fmt::format("inject: {}: worker {} (pid {}) has ended already; skipped", label, w.node,
                       w.pid));
    } else {
      say_(fmt::format(
          "inject: {}: worker {} (pid {}) is not a process of this program on the head's host "
          "(ended already, or on another host?): a head-side injection cannot reach it; skipped "
          "(phase=... "
          "injections are carried out by the worker itself, on any host)",
          label, w.node, w.pid));
    }
  }
  if (victims.empty()) return false;
  std::string who;
  for (const auto* w : victims) {
    who += fmt::format("{}worker {}, pid {}", who.empty() ? "" : "; ", w->node, w->pid);
  }
  if (whole_host) who += fmt::format(" (all of host {})", held->second.domain);
  say_(note.empty() ? fmt::format("inject: {} ({})", label, who)
                    : fmt::format("inject: {} ({}; {})", label, who, note));
  for (const auto* w : victims) {
    log_injection(label, w->node, w->stage, w->replica);
    ::kill(w->pid, what == failure_kind::kill ? SIGKILL : SIGSTOP);
  }
  return true;
}

// Injected failures: once iteration T begins, the worker that runs (stage, replica) then.
void failure_injector::inject_due(std::int64_t next_iteration) {
  const worker_table* workers = workers_();
  if (workers == nullptr) return;
  for (auto& inj : injections_) {
    if (inj.done || inj.phase || inj.during_recovery || inj.during_start ||
        inj.iteration != next_iteration ||
        (inj.what != injection::kind::kill && inj.what != injection::kind::hang)) {
      continue;
    }
    const bool held = std::any_of(workers->begin(), workers->end(), [&](const auto& w) {
      return w.second.stage == inj.stage && w.second.replica == inj.replica;
    });
    if (!held) continue;
    inj.done = true;
    strike(inj.failure(), inj.stage, inj.replica, inj.text(), "", inj.whole_host);
  }
}

std::chrono::steady_clock::time_point failure_injector::due(std::size_t i) const {
  return *train_start_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double>(schedule_[i].at_s));
}

void failure_injector::schedule_due() {
  if (!train_start_ || schedule_closed_ || stopped_) return;
  const auto now = std::chrono::steady_clock::now();
  while (schedule_next_ < schedule_.size() && due(schedule_next_) <= now) {
    if (recovering_ || awaiting_recovery_) return;  // recovery_event("recovery_end") calls again
    const scheduled_failure& f = schedule_[schedule_next_++];
    const double at = std::chrono::duration<double>(now - *train_start_).count();
    const std::string kind = f.what == failure_kind::kill ? "kill" : "hang";
    awaiting_recovery_ =
        strike(f.what, f.stage, f.replica,
               fmt::format("{}: {} stage={} replica={}", f.origin, kind, f.stage, f.replica),
               fmt::format("due at {:.3f} s of training, now {:.3f} s", f.at_s, at));
  }
  if (schedule_next_ < schedule_.size()) {
    schedule_timer_.expires_at(due(schedule_next_));
    schedule_timer_.async_wait([this](const std::error_code& ec) {
      if (!ec) schedule_due();
    });
  }
}

void failure_injector::iteration_ended(std::int64_t iteration) {
  inject_due(iteration + 1);
  if (iteration + 1 >= iterations_) {
    schedule_closed_ = true;  // the end of the job (validation, digests) is not targeted
    schedule_timer_.cancel();
  } else if (!train_start_ && !schedule_.empty()) {
    train_start_ = std::chrono::steady_clock::now();
    schedule_due();
  }
}

// during=recovery: the K-th recovery to start arms the injection, which fires delay_ms later
// at whichever worker then holds (stage, replica): the spare being rebuilt, if it is that one.
void failure_injector::recovery_event(const std::string& event) {
  if (event == "recovery_end") {
    recovering_ = false;
    awaiting_recovery_ = false;
    schedule_due();
    return;
  }
  if (event != "recovery_start") return;
  recovering_ = true;
  const int k = ++recoveries_started_;
  for (std::size_t i = 0; i < injections_.size(); ++i) {
    auto& inj = injections_[i];
    if (inj.done || !inj.during_recovery || inj.nth != k) continue;
    fire_after_delay(i, [this, k] {
      return fmt::format("recovery {} {}", k,
                         recovering_ && recoveries_started_ == k ? "in progress" : "ended");
    });
  }
}

// during=start: as the roles go out (a resumed or requeued job's too), at whichever worker
// holds (stage, replica).
void failure_injector::job_assigned() {
  for (std::size_t i = 0; i < injections_.size(); ++i) {
    if (injections_[i].done || !injections_[i].during_start) continue;
    fire_after_delay(i, [] { return std::string("before training started"); });
  }
}

void failure_injector::fire_after_delay(std::size_t i, std::function<std::string()> note) {
  auto& inj = injections_[i];
  inj.done = true;
  auto fire = [this, i, text = inj.text(), what = inj.failure(), s = inj.stage, d = inj.replica,
               host = inj.whole_host, note = std::move(note)] {
    armed_.erase(i);
    strike(what, s, d, text, note(), host);
  };
  if (inj.delay_ms == 0) {
    fire();
    return;
  }
  armed_.insert(i);
  delayed_.push_back(std::make_unique<asio::steady_timer>(io_));
  delayed_.back()->expires_after(std::chrono::milliseconds(inj.delay_ms));
  delayed_.back()->async_wait([fire](const std::error_code& ec) {
    if (!ec) fire();
  });
}

void failure_injector::stop() {
  stopped_ = true;
  schedule_timer_.cancel();
  for (auto& t : delayed_) t->cancel();
}

void failure_injector::report_unfired(std::ostream& out) const {
  // phase=... injections are the workers' and not known here.
  for (const auto& inj : injections_) {
    if (!inj.done && !inj.phase &&
        (inj.what == injection::kind::kill || inj.what == injection::kind::hang)) {
      out << "inject: " << inj.text() << " did not fire before the job ended\n";
    }
  }
  for (const std::size_t i : armed_) {
    out << "inject: " << injections_[i].text() << " did not fire before the job ended (it was "
        << "armed, and the job ended within its delay_ms)\n";
  }
  if (schedule_next_ < schedule_.size()) {
    out << fmt::format(
        "inject: {} of {} scheduled failure(s) did not fall due before the job ended\n",
        schedule_.size() - schedule_next_, schedule_.size());
  }
}

}  // namespace moevement::launcher
