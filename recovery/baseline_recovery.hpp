// Recovery of the baseline policies, in process over engine::local_pipeline (docs/policies.md):
// - dense-memory / dense-disk: global rollback. Every stage (all its replicas) is restored
//   from one full snapshot of the newest iteration that is snapshotted for every stage, from
//   host memory or from the durable directory; the job resumes at that iteration. A snapshot
//   that does not verify (corrupt, truncated, of another stage or model) is rejected with its
//   reason and an older one is used. Bit-exact: the job then trains on exactly as it would
//   have without the failure.
// - pec: every stage is rolled back to the newest PEC checkpoint: non-experts from it, each
//   expert from its own newest save (stale experts; an expert never saved keeps the fresh
//   stage's initial state). The updates stale experts got after their save are lost: the
//   proportion of lost tokens (PLT, seed 002) measures them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/local_pipeline.hpp"
#include "recovery/dense_capture.hpp"
#include "recovery/pec_capture.hpp"

namespace moevement::recovery {

// No usable snapshot for some stage: says which and why every candidate was rejected.
class rollback_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct rollback_report {
  std::int64_t iteration = 0;         // the job resumes at the start of this iteration
  std::vector<std::string> sources;   // [stage]: where its snapshot came from
  std::vector<std::string> rejected;  // every candidate skipped, with the reason
  std::size_t bytes_loaded = 0;       // snapshot bytes read (one per stage)
};

// The building block of a global rollback, for one stage (what each restarted stage actor
// runs on the bytes it pulled): verifies that `bytes` is a full snapshot of `stage` at
// `iteration` (-1: any) covering every operator of every replica, then loads it into all of
// them. Throws snapshot_error saying what does not fit; nothing is loaded then. The caller
// resumes the job at tag.state_iteration with the returned loss scaler.
struct restored_snapshot {
  snapshot_tag tag;
  models::loss_scaler scaler;
};
restored_snapshot restore_full_snapshot(std::span<const std::byte> bytes, int stage,
                                        std::int64_t iteration,
                                        std::span<engine::stage_model* const> replicas);

// Restores every stage replica of `pipe` from the captures' host-memory snapshots (any
// surviving replica of a stage will do: replicas are identical after the all-reduce) and
// sets the pipeline's position and loss scaler. captures: the survivors, any order.
rollback_report rollback_from_memory(engine::local_pipeline& pipe,
                                     std::span<const dense_capture* const> captures);

// The same from the durable tier: dir holds stage-<s>-replica-<d>/ durable stores (dense-disk,
// checkpoint.dir). Verifies manifests, checksums and the snapshot format; falls back to an
// older iteration when the newest does not verify for some stage.
rollback_report rollback_from_disk(engine::local_pipeline& pipe, const std::filesystem::path& dir);

struct pec_recovery_report {
  std::int64_t iteration = 0;             // resumed at: the newest PEC checkpoint
  std::int64_t failed_at = 0;             // the iteration that was lost (the fault's)
  std::vector<std::string> layers;        // [MoE layer, model order]: gate names
  std::vector<std::int64_t> lost_tokens;  // [MoE layer]: tokens routed to stale experts
  std::int64_t tokens_per_layer = 0;      // input tokens x top_k over iterations [0, failed_at)
  std::size_t stale_experts = 0;          // experts restored older than `iteration`
  // PLT of this fault: mean over MoE layers of lost_tokens / tokens_per_layer.
  double plt = 0.0;
};

// fresh: a freshly built job (as replacement processes are), overwritten. captures: at least
// one surviving replica per stage; schedules[stage]: the stages' shared schedules (their
// counts are job-wide). failed_at: the iteration the fault aborted (>= the checkpoint's).
// Throws rollback_error when a stage has no checkpoint or they disagree.
pec_recovery_report recover_pec(engine::local_pipeline& fresh,
                                std::span<const pec_capture* const> captures,
                                std::int64_t failed_at, const models::model_config& model,
                                const models::train_config& train);

// PLT of a whole run (seed 002): sum over faults and MoE layers of the lost tokens, over
// (MoE layers x input tokens of the run x top_k).
double proportion_of_lost_tokens(std::span<const std::int64_t> lost_tokens_all_faults,
                                 int moe_layers, std::int64_t run_tokens, int top_k);

}  // namespace moevement::recovery
