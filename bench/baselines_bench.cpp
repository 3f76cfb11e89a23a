// `moevement bench baselines [--preset P] [--iterations N] [--repeats R] [--mtbf S]`:
// fault-free iteration time of the baseline checkpoint policies against `moevement`, all in
// one process over engine::local_pipeline (pp=2, dp=1), interleaved, best of R repeats.
//   iteration_s_<policy>_k1: ours = moevement s/iteration (W_sparse from Algorithm 1 on the
//       measured iteration time and snapshot bandwidth), theirs = the policy checkpointing
//       every iteration (its cost per checkpoint, dense-disk's stall included);
//       ratio = theirs / ours (higher: moevement cheaper)
//   overhead_young_<policy>: ours = moevement's overhead over `none`, theirs = the policy's
//       overhead at Young's k, amortised from the k=1 measurement: extra_k1 / k;
//       ratio = (1 + theirs) / (1 + ours)
// In process every capture is a synchronous copy on the compute thread (the actor engine
// overlaps them); dense-disk persists on its own thread as CheckFreq does.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/local_pipeline.hpp"
#include "recovery/baseline_recovery.hpp"
#include "recovery/dense_capture.hpp"
#include "recovery/pec_capture.hpp"
#include "recovery/sparse_capture.hpp"

namespace {

using namespace moevement;
constexpr int pp = 2;

struct options {
  std::string preset = "small";
  int iterations = 6;
  int repeats = 2;
  double mtbf_s = recovery::policy_config{}.mtbf_s;
};

struct measured {
  double seconds = std::numeric_limits<double>::infinity();  // best s/iteration
  double stall_s = 0;                                        // per iteration, that run
  std::size_t bytes = 0;                                     // per checkpoint, per stage 0
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

models::train_config bench_train() {
  models::train_config t;
  t.micro_batches = 2;
  t.micro_batch_size = 2;
  t.seq_len = 64;
  t.data_parallel = 1;
  return t;
}

}  // namespace

int main(int argc, char** argv) try {
  options opt;
  if (argc % 2 == 0) {  // an option without its value (or a stray word) at the end
    throw std::invalid_argument(std::string("no value for ") + argv[argc - 1] +
                                " (--preset, --iterations, --repeats, --mtbf)");
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--preset") {
      opt.preset = v;
    } else if (k == "--iterations") {
      opt.iterations = std::max(1, std::atoi(v.c_str()));
    } else if (k == "--repeats") {
      opt.repeats = std::max(1, std::atoi(v.c_str()));
    } else if (k == "--mtbf") {
      opt.mtbf_s = std::atof(v.c_str());
    } else {
      throw std::invalid_argument("unknown option " + k +
                                  " (--preset, --iterations, --repeats, --mtbf)");
    }
  }
  const auto model = models::preset(opt.preset);
  const auto train = bench_train();
  const auto dir = std::filesystem::temp_directory_path() /
                   fmt::format("moevement_bench_baselines_{}", ::getpid());

  // Profile, in the run (a scratch-buffer copy is several times faster than the copy into
  // two alternating 100 MB buffers between iterations): T without checkpoints, and C, the
  // time after_step spends on one full snapshot of every stage (stages are serialised on this
  // one thread, as their compute is). Bandwidth: stage bytes over that stage's copy time.
  double t_iter = 0, c_snap = 0, full_bytes = 0, stage_c = 0;
  {
    engine::local_pipeline pipe(model, train, pp);
    pipe.train_iteration();
    double t0 = now();
    for (int i = 0; i < 2; ++i) pipe.train_iteration();
    t_iter = (now() - t0) / 2;
    std::vector<std::unique_ptr<recovery::dense_capture>> caps;
    for (int s = 0; s < pp; ++s) {
      caps.push_back(std::make_unique<recovery::dense_capture>(s, 0, 1, &pipe.scaler()));
      pipe.set_hooks(s, 0, caps.back().get());
    }
    for (int i = 0; i < 2; ++i) pipe.train_iteration();  // both buffers allocated
    for (int i = 0; i < 2; ++i) {
      pipe.train_iteration();
      for (int s = 0; s < pp; ++s) {
        const double c = caps[std::size_t(s)]->last_snapshot_seconds();
        c_snap += c / 2;
        if (c > stage_c) {
          stage_c = c;
          full_bytes = double(caps[std::size_t(s)]->snapshot_bytes());
        }
      }
    }
    for (int s = 0; s < pp; ++s) pipe.set_hooks(s, 0, nullptr);
  }
  const double bandwidth = full_bytes / stage_c;
  const int young = recovery::young_interval(c_snap, opt.mtbf_s, t_iter);
  fmt::print(
      "# preset {} pp={} dp=1 mb={}x{}x{}: T = {:.4f} s/iteration, C = {:.4f} s "
      "({:.1f} MB/stage, {:.2f} GB/s), MTBF {} s -> Young k = {}\n",
      opt.preset, pp, train.micro_batches, train.micro_batch_size, train.seq_len, t_iter, c_snap,
      full_bytes / 1e6, bandwidth / 1e9, opt.mtbf_s, young);

  // one run of a policy: build, attach its hooks, 1 warm-up + N timed iterations
  using attach_fn = std::function<std::function<measured()>(engine::local_pipeline&)>;
  std::map<std::string, attach_fn> policies;
  int w_sparse = 0;
  policies["none"] = [](engine::local_pipeline&) { return [] { return measured{}; }; };
  policies["moevement"] = [&](engine::local_pipeline& pipe) {
    auto state =
        std::make_shared<std::pair<std::vector<std::unique_ptr<recovery::stage_schedule>>,
                                   std::vector<std::unique_ptr<recovery::sparse_capture>>>>();
    std::vector<std::vector<models::operator_state*>> stages;
    for (int s = 0; s < pp; ++s) stages.push_back(pipe.stage(s, 0).operators());
    w_sparse = recovery::find_w_sparse(stages, t_iter, bandwidth);
    for (int s = 0; s < pp; ++s) {
      state->first.push_back(std::make_unique<recovery::stage_schedule>(
          recovery::sparse_config{w_sparse}, pipe.stage(s, 0).operators()));
      state->second.push_back(
          std::make_unique<recovery::sparse_capture>(*state->first.back(), s, 0, &pipe.scaler()));
      pipe.set_hooks(s, 0, state->second.back().get());
    }
    return [state] { return measured{0, 0, state->second[0]->last_slot_bytes()}; };
  };
  auto dense = [&](bool disk) {
    return [&, disk](engine::local_pipeline& pipe) {
      auto caps = std::make_shared<std::vector<std::unique_ptr<recovery::dense_capture>>>();
      for (int s = 0; s < pp; ++s) {
        caps->push_back(
            disk ? std::make_unique<recovery::dense_capture>(s, 0, 1, &pipe.scaler(), dir, 2)
                 : std::make_unique<recovery::dense_capture>(s, 0, 1, &pipe.scaler()));
        pipe.set_hooks(s, 0, caps->back().get());
      }
      return std::function<measured()>([caps] {
        measured m;
        for (auto& c : *caps) m.stall_s = std::max(m.stall_s, c->stall_seconds());
        m.bytes = (*caps)[0]->snapshot_bytes();
        for (auto& c : *caps) c->flush();
        return m;
      });
    };
  };
  policies["dense-memory"] = dense(false);
  policies["dense-disk"] = dense(true);
  std::shared_ptr<std::vector<std::unique_ptr<recovery::pec_capture>>> last_pec;
  std::vector<std::unique_ptr<recovery::pec_schedule>> pec_schedules;
  policies["pec"] = [&](engine::local_pipeline& pipe) {
    auto caps = std::make_shared<std::vector<std::unique_ptr<recovery::pec_capture>>>();
    pec_schedules.clear();
    for (int s = 0; s < pp; ++s) {
      pec_schedules.push_back(std::make_unique<recovery::pec_schedule>(
          recovery::policy_config{}.pec_experts, recovery::pec_selection::sequential, 1,
          pipe.stage(s, 0).operators()));
      caps->push_back(
          std::make_unique<recovery::pec_capture>(*pec_schedules.back(), s, 0, &pipe.scaler()));
      pipe.set_hooks(s, 0, caps->back().get());
    }
    last_pec = caps;
    return std::function<measured()>([caps] {
      return measured{0, 0, (*caps)[0]->last_checkpoint_bytes()};
    });
  };

  const std::vector<std::string> order{"none", "moevement", "dense-memory", "dense-disk", "pec"};
  std::map<std::string, measured> best;
  double pec_plt = 0;
  for (int r = 0; r < opt.repeats; ++r) {
    for (const auto& name : order) {
      engine::local_pipeline pipe(model, train, pp);
      auto finish = policies[name](pipe);
      pipe.train_iteration();  // warm-up (first allocation of the capture's buffers)
      const double t0 = now();
      for (int i = 0; i < opt.iterations; ++i) pipe.train_iteration();
      const double per = (now() - t0) / opt.iterations;
      measured m = finish();
      m.stall_s /= opt.iterations + 1;
      auto& b = best[name];
      if (per < b.seconds) b = {per, m.stall_s, m.bytes};
      if (name == "pec" && r == 0) {  // one fault right after the run: PLT of K=1 every iteration
        engine::local_pipeline fresh(model, train, pp);
        std::vector<const recovery::pec_capture*> survivors;
        for (auto& c : *last_pec) survivors.push_back(c.get());
        pec_plt = recovery::recover_pec(fresh, survivors, pipe.iteration(), model, train).plt;
      }
      pipe.set_hooks(0, 0, nullptr);
      pipe.set_hooks(1, 0, nullptr);
    }
  }
  std::filesystem::remove_all(dir);

  const double none = best["none"].seconds, ours = best["moevement"].seconds;
  fmt::print("# none {:.4f} s/it; moevement W_sparse={} slot {:.2f} MB (stage 0)\n", none, w_sparse,
             double(best["moevement"].bytes) / 1e6);
  fmt::print(
      "# dense snapshot {:.2f} MB; dense-disk stall {:.4f} s/iteration at k=1; pec K={} "
      "checkpoint {:.2f} MB, PLT of one fault after {} iterations at k=1: {:.4f}\n",
      double(best["dense-memory"].bytes) / 1e6, best["dense-disk"].stall_s,
      recovery::policy_config{}.pec_experts, double(best["pec"].bytes) / 1e6, opt.iterations + 1,
      pec_plt);
  const double ours_over = ours / none - 1;
  for (const auto& name : {"dense-memory", "dense-disk", "pec"}) {
    std::string id = name;
    std::replace(id.begin(), id.end(), '-', '_');
    const double theirs = best[name].seconds;
    fmt::print("iteration_s_{}_k1: ours={:.4f} theirs={:.4f} ratio={:.3f}\n", id, ours, theirs,
               theirs / ours);
    const double their_over = std::max(0.0, theirs / none - 1) / young;
    fmt::print("overhead_young_{}: ours={:.4f} theirs={:.4f} ratio={:.3f}\n", id, ours_over,
               their_over, (1 + their_over) / (1 + ours_over));
  }
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "bench baselines: {}\n", e.what());
  return 1;
}
