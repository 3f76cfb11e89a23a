// The head's journal of durable windows: what `moevement launch --resume` needs beside the
// stages' windows to start a killed job again where it was (engine::resume_point), and which
// job wrote it. One durable_store under checkpoint.dir/head/, one store window per durable
// window the coordinator saw on disk everywhere, holding one blob:
//   resume.txt
//     moevement-resume 1
//     window <id>
//     w_sparse <W>            (the window's; W may change at a window's start)
//     target_iteration <t>
//     loss_scaler <enabled 0|1> <scale, f32 bits in hex> <good_steps> <window>
//     layout <pp> <dp>        (of the windows; a resume may run at another)
//     durable <id> <first iteration> <its W>                             (one per window)
//     step <iteration> <loss scale bits> <apply 0|1> <grad_mul bits> <grad_norm f64 bits>
//     identity <key> <value>     (what fixes the training state: state_identity())
// Floats are stored as their bits, so that a resumed step is the planned one bit for bit.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/result.hpp"
#include "engine/job_config.hpp"
#include "engine/resume_point.hpp"

namespace moevement::recovery {

// The settings a job's training state depends on, as (key, value) in a fixed order: the
// model, the data and optimizer settings, the checkpoint policy. Settings that change no bit
// (train.iterations, train.device, validation, cluster.*) are not in it, nor the placement:
// a resume may change pp and dp (the journal's layout line says what the windows have).
std::vector<std::pair<std::string, std::string>> state_identity(const engine::job_config& job);

// The first setting of `mine` that `theirs` (read from a file) records otherwise, as
// "train.seed = 1; this config has 7"; nullopt when every one agrees.
std::optional<std::string> identity_difference(
    const std::vector<std::pair<std::string, std::string>>& mine,
    const std::vector<std::pair<std::string, std::string>>& theirs);

// A state identity as the files that record it write it: one "identity <key> <value>" line per
// setting; and one such line read back (the value is the rest of the line: a corpus path may
// hold spaces), nullopt when the line is not one (a file is untrusted).
std::string identity_lines(const std::vector<std::pair<std::string, std::string>>& identity);
std::optional<std::pair<std::string, std::string>> parse_identity_line(const std::string& line);

// checkpoint.dir/head/
std::filesystem::path resume_journal_dir(const std::filesystem::path& checkpoint_dir);

class resume_journal {
 public:
  static constexpr int format_version = 1;

  // Journals of `job` under its checkpoint.dir.
  explicit resume_journal(const engine::job_config& job);

  // Writes `point` atomically (a crash leaves the journals before it loadable) and keeps the
  // newest checkpoint.keep + 2 (as many windows as the stages may hold, and one being
  // written). Throws naming the file on an I/O error.
  void write(const engine::resume_point& point) const;

  // The newest journal that verifies and was written by a job with the same state identity.
  // A journal of another job is an error naming the first setting that differs; corrupt
  // ones are skipped, each reason appended to *rejected. No journal at all: an error saying
  // what the directory holds.
  // `before`: only journals of older windows (a resume none of whose windows is whole goes
  // back to the journal before it).
  result<engine::resume_point> load(std::vector<std::string>* rejected = nullptr,
                                    std::optional<std::uint64_t> before = std::nullopt) const;

  // Deletes every journal (a new job must never resume an older job's).
  void clear() const;
  // Deletes the journals of windows after `window` (a resume went back past them: the windows
  // from then on take their numbers again).
  void drop_after(std::uint64_t window) const;
  // No journal on disk at all (none written yet, or the directory does not exist).
  bool empty() const;

 private:
  std::filesystem::path dir_;
  std::vector<std::pair<std::string, std::string>> identity_;
  std::size_t keep_;
};

// The journal's text, and its strict reading (a file from disk is untrusted: any line out of
// place, count out of range or value that does not parse is an error saying which).
std::string resume_text(const engine::resume_point& point,
                        const std::vector<std::pair<std::string, std::string>>& identity);
result<std::pair<engine::resume_point, std::vector<std::pair<std::string, std::string>>>>
parse_resume_text(const std::string& text);

}  // namespace moevement::recovery
