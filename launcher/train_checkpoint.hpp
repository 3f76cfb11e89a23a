// Checkpoints of `moevement train` (one process, no actors): `--checkpoint-dir DIR` writes the
// whole training state every `--checkpoint-every K` iterations, and `--resume` starts from the
// newest one that verifies, so that a killed `train` goes on where it was and ends with the
// uninterrupted run's state_hash. One durable_store window per checkpoint (id: the iteration
// the state is at the start of), two blobs:
//   state      every operator's master, m, v and step, and the loss scaler (the snapshot.hpp
//              format, checksummed)
//   train.txt  "moevement-train-checkpoint 1", then "identity <key> <value>" per setting the
//              state depends on (recovery::state_identity), so that another job's is refused
// The newest `keep` are kept. Writes are synchronous: `train` is the reference, not a
// production path (`moevement launch` checkpoints without stalling the step).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/job_config.hpp"
#include "models/trainer.hpp"
#include "recovery/durable_store.hpp"

namespace moevement::launcher {

// --checkpoint-every's default: often enough that a kill loses little, rarely enough that the
// writes cost little next to the iterations (the tiny preset's state is 1.2 MB).
inline constexpr int train_checkpoint_every = 10;
inline constexpr std::size_t train_checkpoints_kept = 2;

class train_checkpoints {
 public:
  // Throws (naming the directory) when it cannot be created.
  train_checkpoints(std::filesystem::path dir, const engine::job_config& job);

  // Writes the trainer's state now (at the start of iteration tr.iteration()), then prunes.
  // Throws naming the file on an I/O error; the checkpoints before it stay loadable.
  void write(models::trainer& tr);

  // Loads the newest checkpoint that verifies and was written by this job into `tr` (a
  // freshly built trainer) and returns its iteration. Corrupt ones are skipped, each reason
  // appended to *rejected. Throws std::runtime_error saying what is wrong when none is usable
  // or the newest readable one is another job's (naming the first setting that differs).
  std::int64_t resume(models::trainer& tr, std::vector<std::string>* rejected) const;

 private:
  recovery::durable_store store_;
  std::vector<std::pair<std::string, std::string>> identity_;
};

}  // namespace moevement::launcher
