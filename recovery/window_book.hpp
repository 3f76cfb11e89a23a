// Policy moevement's windows as the head keeps track of them (docs/recovery.md): W_sparse
// (Algorithm 1, with the first iteration as its profile, then re-chosen from what capturing
// costs: window_tuner), where each step's slot goes (window_plan), the step plans a replay applies,
// which window every stage replica has replicated (the newest such is persisted: a recovery
// starts from it), and the durable tier's writes, one window at a time, with what a --resume
// needs beside them (the journal point). Part of region_recovery; through engine::head_control.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/head_recovery.hpp"
#include "recovery/shadow_windows.hpp"
#include "recovery/window_plan.hpp"
#include "recovery/window_tuner.hpp"

namespace moevement::recovery {

// The durable tier's pace (checkpoint.durable_share): the seconds from one durable write's
// start to the next's, its writers' CPU seconds taking `share` of `cores` (the hosts' cores
// where the stages compute on the CPU; 0, GPU stages, or share 0: not paced), at most a week.
double durable_gap_s(double cpu_s, double cores, double share);

class window_book {
 public:
  explicit window_book(engine::head_control& job);

  // Iteration it's step is planned: its plan is kept for replays (W_sparse chosen after the
  // first, re-chosen at a window's start). Returns where its slot goes.
  engine::checkpoint_place planned(const engine::planned_iteration& it);
  // Every stage stepped it: what its checkpoints cost (the tuner's measure).
  void stepped(const engine::iteration_cost& c);
  // A stage replica replicated a window; not persisted while a recovery pulls the persisted one
  // (a newer one would make the replicators drop the slots it pulls).
  void replicated(engine::wire::WindowReplicated::Reader m, bool recovering);
  void durable_written(engine::wire::DurableWritten::Reader m);
  // The next persisted window is written whatever the pace (head_recovery::durable_soon).
  void durable_soon() { durable_soon_ = true; }
  // Persists what was replicated while nothing could persist (a judge's replay held it).
  void persist_held() { maybe_persist(); }
  // A recovery ended at `target` (its rebuilt stages capture from there on); layout_changed:
  // a resume at another layout, whose old windows no restore reads again.
  void recovered(std::int64_t target, bool layout_changed);
  // Silent corruption rolled the job back (region_recovery::roll_back_before): whether a
  // durable window every capture of which precedes step `clean_before` is known, with the
  // step plans and loss scaler a replay to it needs; the loss scaler before iteration
  // `target`; and once every stage is back at `target` from durable window `window`: the
  // windows, steps and plans of the timeline left are forgotten (the windows from here on
  // are numbered past every window it began, so that no copy of one is taken for a new one),
  // and the journal says `window` with `target`, its newer entries dropped.
  bool clean_window_before(std::int64_t clean_before) const;
  bool clean(std::uint64_t window, std::int64_t first, std::int64_t clean_before) const {
    return first + w_of(window) - 2 < clean_before && scalers_.contains(clean_before);
  }
  std::optional<models::loss_scaler> scaler_before(std::int64_t target) const;
  void rolled_back(std::uint64_t window, std::int64_t target, const models::loss_scaler& scaler);
  // --resume: the windows, steps and W_sparse as the journal says (a W fixed by the config
  // from the first window after where training goes on).
  void resume_from(const engine::resume_point& p);
  // A standby head took over from the live stages: the journal's durable windows, the steps
  // since, the lost head's newest persisted window (t.persisted, else the journal's), and
  // windows of t.w_sparse from t.target on, numbered from t.next_window; every stage abandons
  // the windows it began before t.target.
  void take_over(const engine::resume_point& p, const engine::live_takeover& t);
  // The persisted window is only on disk (after a takeover, until one of this head's
  // windows persists): a recovery goes to the durable tier at once.
  bool persisted_on_disk_only() const { return on_disk_only_; }

  int w_sparse() const { return w_sparse_; }  // the newest window's
  int w_of(std::uint64_t window) const;       // that window's (the newest's if unknown)
  bool durable() const { return durable_; }   // checkpoint.durable
  const std::optional<std::uint64_t>& persisted() const { return persisted_; }
  // The durable window being written (asked of every stage, not yet reported whole).
  const std::optional<std::uint64_t>& durable_in_flight() const { return durable_inflight_; }
  std::int64_t persisted_first() const { return persisted_first_; }
  // Which window dp = 1's shadow checks replay from; every recovery, rollback, resume and
  // takeover starts their vouching again. The windows it retains are kept on every stage
  // and replicator, with logs and step plans from the oldest one's first iteration.
  shadow_windows& shadow() { return shadow_; }
  const shadow_windows& shadow() const { return shadow_; }
  // For each window the shadow checks retain, the newest durable window every capture of
  // which precedes it (a rollback past what they find goes back at most that far): kept on
  // disk beside checkpoint.keep's newest.
  std::set<std::uint64_t> durable_kept() const;
  // The durable windows the stages may still hold (window -> first iteration), oldest first.
  const std::map<std::uint64_t, std::int64_t>& durable_windows() const { return durable_windows_; }
  const std::map<std::int64_t, engine::planned_step>& steps() const { return steps_; }
  // Iterations stepped since the persisted window's last (-1: none persisted yet).
  std::int64_t replication_lag(std::int64_t iteration) const;

 private:
  // The journal's windows, steps and W_sparse, where training goes on (resume and takeover).
  void go_on_from(const engine::resume_point& p);
  void choose_window_size(const engine::planned_iteration& it);
  // One past every window number this head has planned, heard of or persisted.
  std::uint64_t next_window_number() const;
  // At a window's first step, planned for the first time: W for it from the tuner.
  void retune(std::int64_t step);
  void make_tuner();  // with Algorithm 1's W and checkpoint.max_overhead > 0
  // The cores of the hosts with a stage where the stages compute on the CPU (0 on GPUs).
  double cpu_cores() const;
  // A window not on every stage's replicators long after it began: a notice and a run log
  // `window_stalled` event naming the stage replicas it waits for (once per window).
  void report_stall(std::int64_t iteration);
  // Persists the newest window every stage has replicated; asks for its durable write.
  void maybe_persist();
  // Every stage's checkpoint agent and every replicator: `window` (from `first`) is persisted
  // (the agents write it to disk when `durable`); windows begun before `before` are abandoned.
  void tell_persisted(std::uint64_t window, std::int64_t first, bool durable);
  void tell_abandoned(std::int64_t before);
  // Every replicator: the job restarted from durable window `window` (WindowPersisted.restart).
  void tell_restarted(std::uint64_t window);
  // What a resume from durable window `window` needs to go on at `target` with `scaler`
  // (head_control::durable_window).
  engine::resume_point journal_point(std::uint64_t window, std::int64_t target,
                                     const models::loss_scaler& scaler) const;

  engine::head_control& job_;
  bool durable_ = false;
  int w_sparse_ = 0;
  window_plan plan_;
  std::optional<window_tuner> tuner_;                      // W chosen by Algorithm 1 and tuned
  std::int64_t planned_max_ = -1;                          // the newest step planned
  std::map<std::uint64_t, int> resumed_sizes_;             // --resume: the journal's windows' W
  std::map<std::int64_t, engine::planned_step> steps_;     // from the oldest window kept
  std::map<std::int64_t, models::loss_scaler> scalers_;    // before each iteration, as steps_
  std::map<std::uint64_t, std::vector<bool>> replicated_;  // window -> [d * pp + s] done
  std::map<std::uint64_t, std::int64_t> window_first_;
  // window -> [stage * ep + EP rank]
  std::map<std::uint64_t, std::vector<std::uint64_t>> schedule_digests_;
  std::optional<std::uint64_t> persisted_;  // the newest window every stage has replicated
  bool on_disk_only_ = false;         // persisted_ is the journal's (take_over, none in memory)
  std::int64_t persisted_first_ = 0;  // the first iteration its conversion replays
  // The durable tier: one persisted window at a time is written by every stage; the windows
  // asked for (window -> first iteration), the newest checkpoint.keep + 2, whose step plans
  // are kept for a rollback to them.
  std::optional<std::uint64_t> durable_inflight_;
  std::vector<bool> durable_reported_;  // [d * pp + s] of durable_inflight_
  std::uint64_t durable_bytes_ = 0;
  double durable_seconds_ = 0.0;
  std::int64_t durable_errors_ = 0;
  // Per stage replica: its failed durable writes, and when the console was last told of them
  // (the first at once, then at most once a minute: a full disk fails every window, each
  // error naming its own file).
  struct durable_failures {
    std::int64_t count = 0;
    std::chrono::steady_clock::time_point noticed_at;
  };
  std::map<std::pair<int, int>, durable_failures> durable_failed_;
  double durable_cpu_s_ = 0.0;  // the writers' CPU seconds, summed
  // When the window in flight began to be written, and when the next may (durable_gap_s).
  std::chrono::steady_clock::time_point durable_started_{}, durable_next_{};
  bool durable_soon_ = false;  // unpaced until a window is journaled (durable_soon)
  std::map<std::uint64_t, std::int64_t> durable_windows_;
  // The newest durable window written whole by every stage (the journal's newest): kept on
  // every stage's disk whatever checkpoint.keep says, while newer ones fail to write on some.
  std::optional<std::uint64_t> newest_whole_;
  std::int64_t durable_from_ = 0;  // the first iteration a durable window may begin at
  std::optional<std::uint64_t> stall_reported_;  // the newest window reported as stalled
  std::uint64_t first_live_window_ = 0;          // older ones are of a timeline a rollback left
  shadow_windows shadow_;
};

}  // namespace moevement::recovery
