// Where the copies of each stage worker's snapshots (and dense checkpoints) go: the r
// replicators that hold them. Deterministic: the same workers give the same placement.
//
// What it is for (DESIGN.md, recovery step 7): losing any one host (failure domain), or any
// contiguous run of up to half the pipeline's stages (floor(pp / 2), in any replicas),
// leaves a copy of every slot. A holder is *run-safe* for an owner at stage s when it is a
// spare or runs a stage t with |t - s| >= floor(pp / 2): no run of that length holds both.
// Copies are chosen one at a time, each preferring, in this order:
//   1. a property not yet covered by the copies chosen: another domain than the owner's,
//      run-safe (both when one candidate has both);
//   2. another domain than the owner's;
//   3. a domain that runs no other replica of the owner's stage;
//   4. a domain no chosen copy is on;
//   5. run-safe;
//   6. fewer copies held already (load);
//   7. another stage than the owner's;
//   8. the next node after the owner's, in node order (wrapping): spreads the ties.
// So with r >= 2 both properties hold whenever some candidates have them, and with r = 1 the
// one copy has both when a candidate does. Spares are candidates (they are never in a run).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "transport/link.hpp"

namespace moevement::engine {

struct placement_candidate {
  transport::node_id node = 0;
  int stage = -1;      // -1: a spare
  std::string domain;  // failure domain: Slurm node, else host
};

// Holders of every stage worker's copies (stage >= 0 in `workers`), at most `copies` each
// (fewer when there are fewer other workers), keyed by the owner's node.
std::map<transport::node_id, std::vector<transport::node_id>> place_snapshot_copies(
    const std::vector<placement_candidate>& workers, int pp, int copies);

// Whether a holder at stage `holder_stage` (-1: spare) survives every contiguous run of up to
// floor(pp / 2) stages that contains `owner_stage`.
bool run_safe(int owner_stage, int holder_stage, int pp);

}  // namespace moevement::engine
