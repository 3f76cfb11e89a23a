// What `moevement launch` checks and opens before its head starts: the run log's path, and
// under the durable tier its directory and the resume journal. Each refusal names the key or
// the option to change.
#pragma once

#include <optional>
#include <string>

#include "engine/job_config.hpp"
#include "launcher/launch_options.hpp"
#include "recovery/resume_journal.hpp"

namespace moevement::launcher {

// Where the run log goes, checked before anything is made beside it (its checkpoint.dir by
// default): a bad engine.run_log is named as such, not as the directory made from it. Throws
// std::invalid_argument.
void check_run_log_path(const std::string& path);

// The head's journal of durable windows (policy moevement with the durable tier): read by a
// resume (the point it starts from), started afresh by a new job. Throws what to change.
std::optional<engine::resume_point> open_journal(const launch_options& o,
                                                 const engine::job_config& job,
                                                 std::optional<recovery::resume_journal>& journal);

}  // namespace moevement::launcher
