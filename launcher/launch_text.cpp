#include "launcher/launch_text.hpp"

#include <fmt/format.h>

namespace moevement::launcher {

std::string launch_line(const engine::job_config& job) {
  // The built-in model's size; a custom stage type builds its own operators from the config's
  // shapes, which only its stages know.
  const std::string model =
      job.stage_type == "moe"
          ? fmt::format("model {} ({} layers, {:.3f} M parameters)", job.model.preset,
                        job.model.layers, double(job.model.parameter_count()) / 1e6)
          : fmt::format("model {} shapes, {} layers", job.model.preset, job.model.layers);
  return fmt::format(
      "moevement launch: {}, pp={} dp={}{}, {} workers + {} spare(s), stage type {}, checkpoint "
      "policy {}",
      model, job.pp, job.dp, job.ep > 1 ? fmt::format(" ep={}", job.ep) : std::string(),
      job.workers(), job.spares, job.stage_type, engine::policy_name(job.policy));
}

std::string duration_text(double s) {
  const auto total = static_cast<long>(s + 0.5);
  return fmt::format("{}:{:02d}", total / 60, static_cast<int>(total % 60));
}

std::string final_line(const engine::job_outcome& o) {
  const auto loss = [](const std::optional<double>& v) {
    return v ? fmt::format("{:.4f}", *v) : std::string("-");
  };
  // The seconds the committed iterations took (what tokens/s divides), then the run's wall
  // time: their difference is what failures cost beyond re-run iterations (engine.md).
  const std::string secs =
      fmt::format("{:.2f} s in iterations, {:.2f} s wall", o.seconds, o.wall_s);
  const std::string run = o.first_iteration > 0
                              ? fmt::format("{} iterations, {} of them in this run: {}",
                                            o.iterations, o.iterations - o.first_iteration, secs)
                              : fmt::format("{} iterations, {}", o.iterations, secs);
  const bool trained = o.iterations > o.first_iteration;
  return fmt::format("final: loss {}  val_loss {}  tokens/s {:.0f}  ({})  ETTR {}{}",
                     loss(o.final_loss), loss(o.val_loss), o.tokens_per_s, run,
                     trained ? fmt::format("{:.3f}", o.ettr) : std::string("-"),
                     trained && o.first_iteration > 0 ? " (this run's)" : "");
}

}  // namespace moevement::launcher
