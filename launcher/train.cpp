#include "launcher/train.hpp"

#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/hash.hpp"
#include "engine/job_config.hpp"
#include "launcher/config.hpp"
#include "launcher/train_checkpoint.hpp"
#include "models/cuda/device.hpp"
#include "models/cuda/trainer.hpp"
#include "models/trainer.hpp"

namespace moevement::launcher {

namespace {
constexpr const char* train_usage =
    "usage: moevement train CONFIG [--set key=value ...] [--checkpoint-dir DIR\n"
    "                       [--checkpoint-every K] [--resume]]\n"
    "  CONFIG: a TOML file (examples/configs/tiny.toml); keys in docs/configuration.md\n"
    "  --checkpoint-dir: write the whole training state there every K iterations (default 10)\n"
    "  --resume: start from the newest checkpoint in DIR that verifies (a killed run goes on\n"
    "            where it was and ends with the uninterrupted run's state_hash)\n";

struct train_options {
  std::string config;
  std::vector<std::string> overrides;
  std::string checkpoint_dir;
  int checkpoint_every = train_checkpoint_every;
  bool every_given = false;  // --checkpoint-every on the command line
  bool resume = false;
};

// Throws std::invalid_argument saying what is wrong.
train_options parse_train_options(int argc, char** argv) {
  train_options o;
  o.config = argv[2];
  for (int i = 3; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--set") {
      o.overrides.push_back(value());
    } else if (a.starts_with("--set=")) {
      o.overrides.push_back(a.substr(6));
    } else if (a == "--checkpoint-dir") {
      o.checkpoint_dir = value();
    } else if (a == "--checkpoint-every") {
      const std::string v = value();
      std::size_t used = 0;
      try {
        o.checkpoint_every = std::stoi(v, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      o.every_given = true;
      if (used != v.size() || o.checkpoint_every < 1) {
        throw std::invalid_argument("--checkpoint-every needs a whole number >= 1, not '" + v +
                                    "'");
      }
    } else if (a == "--resume") {
      o.resume = true;
    } else {
      throw std::invalid_argument("unexpected argument '" + a + "'");
    }
  }
  if (o.resume && o.checkpoint_dir.empty()) {
    throw std::invalid_argument("--resume needs --checkpoint-dir DIR (where the run wrote them)");
  }
  if (o.every_given && o.checkpoint_dir.empty()) {
    throw std::invalid_argument(
        "--checkpoint-every needs --checkpoint-dir DIR (where the checkpoints go)");
  }
  return o;
}

// The training loop and its report, for the CPU and the CUDA trainer alike.
// after_step(tr): once each iteration, after its step (checkpoints).
template <class Trainer, class AfterStep>
int train_loop(Trainer& tr, const models::model_config& model, const models::train_config& train,
               std::int64_t first, AfterStep after_step) {
  std::cout << fmt::format(
      "model {}: {} layers, d_model {}, {} experts (top-{}), {:.3f} M parameters ({:.3f} M "
      "active), compute {}, {} replica(s)\n",
      model.preset, model.layers, model.d_model, model.experts, model.top_k,
      double(model.parameter_count()) / 1e6, double(model.active_parameter_count()) / 1e6,
      models::dtype_name(model.compute_dtype), train.data_parallel);
  if (train.device == models::device::cuda)
    std::cout << "device: " << models::cuda::describe_device() << "\n";
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  models::iteration_stats st;
  for (std::int64_t it = first; it < train.iterations; ++it) {
    st = tr.train_iteration();
    after_step(tr);
    const bool last = it + 1 == train.iterations;
    if (it % train.log_every == 0 || last) {
      const double secs = std::chrono::duration<double>(clock::now() - start).count();
      std::cout << fmt::format(
          "iter {:6d}  loss {:.4f}  aux {:.4f}  grad_norm {:.3f}{}  tok/s {:.0f}\n", it, st.loss,
          st.aux_loss, st.grad_norm, st.applied ? "" : "  (skipped: fp16 overflow)",
          double(tr.tokens_per_iteration()) * double(it + 1 - first) / secs);
    }
    if (train.val_every > 0 && (it + 1) % train.val_every == 0 && !last) {
      std::cout << fmt::format("iter {:6d}  val_loss {:.4f}\n", it, tr.validation_loss());
    }
  }
  const double secs = std::chrono::duration<double>(clock::now() - start).count();
  // "-": nothing measured (no iteration in this run, train.val_batches = 0).
  const std::string loss = train.iterations > first ? fmt::format("{:.4f}", st.loss) : "-";
  const std::string val = train.val_batches > 0 ? fmt::format("{:.4f}", tr.validation_loss()) : "-";
  std::cout << fmt::format(
      "final: loss {}  val_loss {}  tokens/s {:.0f}  ({} iterations, "
      "{:.2f} s)\n",
      loss, val,
      secs > 0 ? double(tr.tokens_per_iteration()) * double(train.iterations - first) / secs : 0.0,
      train.iterations - first, secs);
  std::cout << "state_hash=" << hex16(tr.state_hash()) << "\n";
  return 0;
}

}  // namespace

int run_train(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << train_usage;
    return 2;
  }
  train_options o;
  try {
    o = parse_train_options(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::cerr << "moevement train: " << e.what() << "\n" << train_usage;
    return 2;
  }
  models::config_map map = load_config_file(o.config);
  for (const auto& kv : o.overrides) apply_override(map, kv);
  // A custom stage type builds other operators than the MoE this trains: its hash would not
  // be that job's reference.
  if (const auto stage = map.find("engine.stage"); stage != map.end()) {
    if (const std::string type = models::config_string(stage->first, stage->second);
        type != "moe") {
      throw std::invalid_argument(fmt::format(
          "engine.stage: `moevement train` trains the built-in MoE stage only, not {}; a "
          "custom stage type runs under `launch` (docs/custom-stages.md)",
          type));
    }
  }
  // `train` reads model.*, train.* and parallel.dp (it emulates the data-parallel replicas in
  // this process, so it is the bit-exact reference of `launch`); the engine's other keys are
  // ignored so that one file serves both. Anything else is an unknown key.
  // They are checked as `launch` checks them, though: a typo or a bad value there would
  // otherwise pass here and fail only under `launch`.
  {
    models::config_map whole;
    for (const auto& [key, value] : map) {
      if (!key.starts_with("inject.")) whole.emplace(key, value);
    }
    (void)engine::resolve_job(std::move(whole));
  }
  models::config_map own;
  for (auto& [key, value] : map) {
    if (!is_engine_section(key) || key == "parallel.dp") own.emplace(key, std::move(value));
  }
  const engine::job_config job = engine::resolve_job(std::move(own));
  check_host_memory(job.model, job.train);
  const models::model_config& model = job.model;
  const models::train_config& train = job.train;
  if (train.device == models::device::cuda) {
    if (!o.checkpoint_dir.empty()) {
      throw std::invalid_argument(
          "moevement train: --checkpoint-dir is for CPU training (train.device = \"cpu\"); GPU "
          "stages checkpoint and resume under `moevement launch` (docs/recovery.md)");
    }
    models::cuda::trainer tr(model, train);
    return train_loop(tr, model, train, 0, [](auto&) {});
  }
  models::trainer tr(model, train);
  if (o.checkpoint_dir.empty()) return train_loop(tr, model, train, 0, [](auto&) {});
  if (o.resume && !std::filesystem::is_directory(o.checkpoint_dir)) {
    throw std::invalid_argument(fmt::format(
        "nothing to resume: {} is not a directory (--checkpoint-dir names where the run wrote "
        "its checkpoints)",
        o.checkpoint_dir));
  }
  train_checkpoints checkpoints(o.checkpoint_dir, job);
  std::int64_t first = 0;
  if (o.resume) {
    std::vector<std::string> rejected;
    try {
      first = checkpoints.resume(tr, &rejected);
    } catch (const std::runtime_error& e) {
      for (const auto& r : rejected) std::cerr << "moevement train: " << r << "\n";
      throw;
    }
    for (const auto& r : rejected) std::cout << "skipped " << r << "\n";
    if (first > train.iterations) {
      throw std::runtime_error(fmt::format(
          "the checkpoint in {} is of iteration {}, past train.iterations = {}: resume with "
          "train.iterations of at least {} (the run's own, say), or train anew in another "
          "--checkpoint-dir",
          o.checkpoint_dir, first, train.iterations, first));
    }
    std::cout << fmt::format("resumed from the checkpoint of iteration {} in {}\n", first,
                             o.checkpoint_dir);
  }
  return train_loop(tr, model, train, first, [&](models::trainer& t) {
    if (t.iteration() % o.checkpoint_every == 0) checkpoints.write(t);
  });
}

}  // namespace moevement::launcher
