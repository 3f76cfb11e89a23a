// The root of the recovery tree on the head (docs/recovery.md "The recovery tree"): the job
// supervisor, an actors::supervisor (one_for_one) whose children are the job's region
// supervisors (recovery/region_supervisor.hpp), one per recovery region. A region supervisor
// is a temporary child: one that gives up (past checkpoint.region_restarts, or it could not
// start its children) is not restarted but escalated, which is the job supervisor's strategy:
// it tells the coordinator (RegionEscalated), whose recovery falls back to the durable tier's
// rollback of the whole job, or stops the job. A region stopped on purpose (its recovery
// ended, or it merged into another) ends with shutdown and is not escalated. Linked to the
// coordinator: the job's end takes the whole tree down, and the tree's end stops the job.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "actors/supervisor.hpp"
#include "engine/head_recovery.hpp"
#include "recovery/region_supervisor.hpp"

namespace moevement::recovery {

class job_supervisor : public actors::supervisor {
 public:
  using interface = actors::supervisor::interface;
  explicit job_supervisor(actors::actor_ref coordinator);

 protected:
  asio::awaitable<void> child_ended(const std::string& id, actors::actor_ref who,
                                    const actors::exit_reason& why) override;

 private:
  actors::actor_ref coordinator_;
};

// A head recovery's hold on its tree, used in the coordinator's turns: the job supervisor is
// started with the first region and lives until the job ends.
class recovery_tree {
 public:
  explicit recovery_tree(engine::head_control& job) : job_(job) {}

  // Starts region `region`'s supervisor under the job supervisor: `members` children, whose
  // workers its restarts write into `nodes`. Returns its ref (invalid if the tree could not
  // start: the job failed, saying so).
  actors::actor_ref start_region(std::uint64_t region,
                                 std::shared_ptr<region_supervisor::member_nodes> nodes,
                                 std::size_t members);
  // Stops a region's supervisor on purpose (its end is not an escalation) and clears the ref.
  void stop_region(actors::actor_ref& supervisor);
  // The job supervisor (invalid before the first region, and after stop()).
  actors::actor_ref root() const { return root_; }
  // The job ended: the tree goes, children first.
  void stop();

 private:
  engine::head_control& job_;
  actors::actor_ref root_;
};

}  // namespace moevement::recovery
