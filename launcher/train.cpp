#include "launcher/train.hpp"

#include <fmt/format.h>

#include <chrono>
#include <iostream>
#include <string>

#include "base/hash.hpp"
#include "engine/job_config.hpp"
#include "launcher/config.hpp"
#include "models/cuda/device.hpp"
#include "models/cuda/trainer.hpp"
#include "models/trainer.hpp"

namespace moevement::launcher {

namespace {
constexpr const char* train_usage =
    "usage: moevement train CONFIG [--set key=value ...]\n"
    "  CONFIG: a TOML file (examples/configs/tiny.toml); keys in docs/configuration.md\n";

// The training loop and its report, for the CPU and the CUDA trainer alike.
template <class Trainer>
int train_loop(Trainer& tr, const models::model_config& model, const models::train_config& train) {
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
  for (std::int64_t it = 0; it < train.iterations; ++it) {
    st = tr.train_iteration();
    const bool last = it + 1 == train.iterations;
    if (it % train.log_every == 0 || last) {
      const double secs = std::chrono::duration<double>(clock::now() - start).count();
      std::cout << fmt::format(
          "iter {:6d}  loss {:.4f}  aux {:.4f}  grad_norm {:.3f}{}  tok/s {:.0f}\n", it, st.loss,
          st.aux_loss, st.grad_norm, st.applied ? "" : "  (skipped: fp16 overflow)",
          double(tr.tokens_per_iteration()) * double(it + 1) / secs);
    }
    if (train.val_every > 0 && (it + 1) % train.val_every == 0 && !last) {
      std::cout << fmt::format("iter {:6d}  val_loss {:.4f}\n", it, tr.validation_loss());
    }
  }
  const double secs = std::chrono::duration<double>(clock::now() - start).count();
  const double val = tr.validation_loss();
  std::cout << fmt::format(
      "final: loss {:.4f}  val_loss {:.4f}  tokens/s {:.0f}  ({} iterations, "
      "{:.2f} s)\n",
      st.loss, val, secs > 0 ? double(tr.tokens_per_iteration()) * train.iterations / secs : 0.0,
      train.iterations, secs);
  std::cout << "state_hash=" << hex16(tr.state_hash()) << "\n";
  return 0;
}

}  // namespace

int run_train(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << train_usage;
    return 2;
  }
  models::config_map map = load_config_file(argv[2]);
  for (int i = 3; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--set" && i + 1 < argc) {
      apply_override(map, argv[++i]);
    } else if (a.starts_with("--set=")) {
      apply_override(map, a.substr(6));
    } else {
      std::cerr << "moevement train: unexpected argument '" << a << "'\n" << train_usage;
      return 2;
    }
  }
  // `train` reads model.*, train.* and parallel.dp (it emulates the data-parallel replicas in
  // this process, so it is the bit-exact reference of `launch`); the engine's other keys are
  // accepted and ignored so that one file serves both. Anything else is an unknown key.
  models::config_map own;
  for (auto& [key, value] : map) {
    if (!is_engine_section(key) || key == "parallel.dp") own.emplace(key, std::move(value));
  }
  const engine::job_config job = engine::resolve_job(std::move(own));
  check_host_memory(job.model, job.train);
  const models::model_config& model = job.model;
  const models::train_config& train = job.train;
  if (train.device == models::device::cuda) {
    models::cuda::trainer tr(model, train);
    return train_loop(tr, model, train);
  }
  models::trainer tr(model, train);
  return train_loop(tr, model, train);
}

}  // namespace moevement::launcher
