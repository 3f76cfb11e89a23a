// The recovery tree of policy moevement (docs/recovery.md "The recovery tree"): on the head,
// under the coordinator (the job's supervisor), one region_supervisor per recovery region.
// It is an actors::supervisor (one_for_all) whose children stand for the region's members:
// one region_member actor on each member's worker (the spare rebuilding a lost role, or a
// surviving replica replaying beside it), spawned there by registered name and linked. The
// loss of a member's worker reaches the supervisor as that child's exit: it stops the other
// children, asks the coordinator for the region's next generation (RegionRestart: a spare for
// every role whose worker is gone, the Restores sent; the answer says where each member runs
// now) and starts a child on each member's worker again. A loss next to the region grows it
// (supervisor::grow, counted as a restart). Past checkpoint.region_restarts restarts it gives
// up; the coordinator sees its exit and escalates (the durable tier's rollback of the whole
// job, or the job stops).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "actors/supervisor.hpp"

namespace moevement::recovery {

// On every worker (registered as region_member::registered_name): the supervised child that
// stands for this worker's part in a region's recovery while the region recovers. Its worker's
// loss is its exit; it has no messages of its own (the Restore goes to the worker's agent).
class region_member : public actors::actor {
 public:
  using interface = actors::interface<>;
  static constexpr const char* registered_name = "moevement.region_member";
};

class region_supervisor : public actors::supervisor {
 public:
  using interface = actors::supervisor::interface;
  // Where the members run, by member index: written by before_start, read by the children's
  // start functions (child_spec::start cannot reach the supervisor itself).
  using member_nodes = std::vector<transport::node_id>;

  // region: the coordinator's id of the region; members: its members at the start;
  // max_restarts: checkpoint.region_restarts.
  region_supervisor(std::uint64_t region, actors::actor_ref coordinator,
                    std::shared_ptr<member_nodes> nodes, std::size_t members, int max_restarts);

  // Children for members [from, from + count) (a region that grew).
  static std::vector<actors::child_spec> member_specs(std::shared_ptr<member_nodes> nodes,
                                                      std::size_t from, std::size_t count);

 protected:
  asio::awaitable<result<void>> before_start() override;

 private:
  std::uint64_t region_;
  actors::actor_ref coordinator_;
  std::shared_ptr<member_nodes> nodes_;
};

}  // namespace moevement::recovery
