// `moevement bench model`: training throughput of the `small` preset, against BLIS running the
// same GEMM shapes back to back (the model's step can at best be as fast as its GEMMs).
//   small_tokens_per_s: ours = tokens/s of whole training steps (forward, backward, AdamW)
//                       theirs = tokens/s if a step cost only its GEMMs at BLIS's rate
//   gemm_gflops:        ours = the step's GEMM FLOPs / step time; theirs = BLIS on the shapes
// Both ratios are the fraction of BLIS's FLOP rate the whole step reaches (goal >= 0.5).
// Timings take the best of interleaved repeats (the machine is shared); one BLIS thread.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/hash.hpp"
#include "models/cpu/gemm.hpp"
#include "models/rng.hpp"
#include "models/trainer.hpp"

namespace {

using namespace moevement::models;

struct gemm_shape {
  bool ta, tb;
  int m, n, k, lda, ldb, ldc;
};

// Every GEMM one micro-batch runs (forward and backward), in the model's orientations. The
// expert rows are the dropless total N*K split evenly (the model's split varies per batch;
// the FLOP total is the same).
std::vector<gemm_shape> step_gemms(const model_config& m, const train_config& t) {
  const int n = t.micro_batch_size * t.seq_len, c = m.d_model, f = m.d_ff, e = m.experts;
  const int hs = c / m.heads, tt = t.seq_len;
  std::vector<gemm_shape> g;
  auto linear = [&g](int rows, int in, int out) {
    g.push_back({false, false, rows, out, in, in, out, out});  // y = x W
    g.push_back({false, true, rows, in, out, out, out, in});   // dx = dy W^T
    g.push_back({true, false, in, out, rows, in, out, out});   // dW += x^T dy
  };
  for (int l = 0; l < m.layers; ++l) {
    linear(n, c, 3 * c);
    for (int i = 0; i < t.micro_batch_size * m.heads; ++i) {
      g.push_back({false, true, tt, tt, hs, 3 * c, 3 * c, tt});   // q k^T
      g.push_back({false, false, tt, hs, tt, tt, 3 * c, c});      // att v
      g.push_back({false, true, tt, tt, hs, c, 3 * c, tt});       // datt
      g.push_back({true, false, tt, hs, tt, tt, c, 3 * c});       // dv
      g.push_back({false, false, tt, hs, tt, tt, 3 * c, 3 * c});  // dq
      g.push_back({true, false, tt, hs, tt, tt, 3 * c, 3 * c});   // dk
    }
    linear(n, c, c);
    linear(n, c, e);
    const int rows = n * m.top_k / e;
    for (int j = 0; j < e; ++j) {
      linear(rows, c, f);
      linear(rows, f, c);
    }
  }
  linear(n, c, m.vocab);
  return g;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 3;
  const model_config m = preset("small");
  train_config t;
  t.micro_batches = 2;
  t.micro_batch_size = 4;
  t.seq_len = 128;
  t.blis_threads = 1;
  trainer tr(m, t);
  tr.train_iteration();  // warm-up: first-touch of every buffer

  const auto shapes = step_gemms(m, t);
  double flops_mb = 0.0;
  std::size_t a_max = 0, b_max = 0, c_max = 0;
  for (const auto& s : shapes) {
    flops_mb += 2.0 * s.m * s.n * s.k;
    a_max = std::max<std::size_t>(a_max, std::size_t(s.ta ? s.k : s.m) * s.lda);
    b_max = std::max<std::size_t>(b_max, std::size_t(s.tb ? s.n : s.k) * s.ldb);
    c_max = std::max<std::size_t>(c_max, std::size_t(s.m) * s.ldc);
  }
  const double flops_step = flops_mb * t.micro_batches;
  std::vector<float> a(a_max), b(b_max), c(c_max, 0.0f);
  const auto key = make_key({42});
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = float(random_uniform(key, i) - 0.5);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = float(random_uniform(key, i + a.size()) - 0.5);

  double best_step = 1e30, best_gemm = 1e30;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    tr.train_iteration();
    best_step = std::min(best_step, seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    for (int mb = 0; mb < t.micro_batches; ++mb) {
      for (const auto& s : shapes) {
        cpu::sgemm(s.ta, s.tb, s.m, s.n, s.k, 1.0f, a.data(), s.lda, b.data(), s.ldb,
                   s.ta ? 1.0f : 0.0f, c.data(), s.ldc);
      }
    }
    best_gemm = std::min(best_gemm, seconds_since(t0));
  }
  const double tokens = double(tr.tokens_per_iteration());
  fmt::print(
      "# small: {:.1f} M parameters, {} tokens per step (B={} T={} M={}), {:.2f} GFLOP of "
      "GEMM per step, best of {} steps, 1 BLIS thread\n",
      double(m.parameter_count()) / 1e6, tokens, t.micro_batch_size, t.seq_len, t.micro_batches,
      flops_step / 1e9, repeats);
  fmt::print("# step {:.3f} s, the same GEMMs alone {:.3f} s\n", best_step, best_gemm);
  const double ours_tps = tokens / best_step, theirs_tps = tokens / best_gemm;
  fmt::print("small_tokens_per_s: ours={:.1f} theirs={:.1f} ratio={:.3f}\n", ours_tps, theirs_tps,
             ours_tps / theirs_tps);
  const double ours_gf = flops_step / best_step / 1e9, theirs_gf = flops_step / best_gemm / 1e9;
  fmt::print("gemm_gflops: ours={:.2f} theirs={:.2f} ratio={:.3f}\n", ours_gf, theirs_gf,
             ours_gf / theirs_gf);
  fmt::print("state_hash={}\n", moevement::hex16(tr.state_hash()));
  return 0;
}
