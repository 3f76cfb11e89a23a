// `moevement bench model`: training throughput of the `small` preset, against BLIS running the
// same GEMM shapes back to back (the model's step can at best be as fast as its GEMMs).
//   small_tokens_per_s: ours = tokens/s of whole training steps (forward, backward, AdamW)
//                       theirs = tokens/s if a step cost only its GEMMs at BLIS's rate
//   gemm_gflops:        ours = the step's GEMM FLOPs / step time; theirs = BLIS on the shapes
// Both ratios are the fraction of BLIS's FLOP rate the whole step reaches (goal >= 0.5).
// Timings take the best of interleaved repeats (the machine is shared); one BLIS thread.
//
// `moevement bench model --device cuda [--repeats R] [--micro-batch-size B]`: the same on one
// GPU, against cuBLAS on the same shapes (FP32, pedantic math as the trainer uses it), and a
// second training run that must end in the same state_hash bit for bit (run to run).
//   gpu_small_tokens_per_s, gpu_gemm_gflops: as above with cuBLAS as the competitor
//   gpu_run_to_run: ours = state_hash of run 1, theirs = of run 2 (exit 1 if they differ)
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/hash.hpp"
#include "models/cpu/gemm.hpp"
#include "models/cuda/device.hpp"
#include "models/cuda/kernels.hpp"
#include "models/cuda/trainer.hpp"
#include "models/rng.hpp"
#include "models/trainer.hpp"

namespace {

using namespace moevement::models;

struct gemm_shape {
  bool ta, tb;
  int m, n, k, lda, ldb, ldc;
  long sa = 0, sb = 0, sc = 0;  // strides between the products of a batch
  int batch = 1;
};

// Every GEMM one micro-batch runs (forward and backward), in the model's orientations. The
// expert rows are the dropless total N*K split evenly (the model's split varies per batch;
// the FLOP total is the same).
// batched_heads: the attention GEMMs of one sequence as one strided batch over the heads, as
// the CUDA backend calls cuBLAS (per-head calls would make the GPU competitor launch-bound).
std::vector<gemm_shape> step_gemms(const model_config& m, const train_config& t,
                                   bool batched_heads = false) {
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
    if (batched_heads) {
      const long st = long(tt) * tt;
      for (int i = 0; i < t.micro_batch_size; ++i) {
        g.push_back({false, true, tt, tt, hs, 3 * c, 3 * c, tt, hs, hs, st, m.heads});   // q k^T
        g.push_back({false, false, tt, hs, tt, tt, 3 * c, c, st, hs, hs, m.heads});      // att v
        g.push_back({false, true, tt, tt, hs, c, 3 * c, tt, hs, hs, st, m.heads});       // datt
        g.push_back({true, false, tt, hs, tt, tt, c, 3 * c, st, hs, hs, m.heads});       // dv
        g.push_back({false, false, tt, hs, tt, tt, 3 * c, 3 * c, st, hs, hs, m.heads});  // dq
        g.push_back({true, false, tt, hs, tt, tt, 3 * c, 3 * c, st, hs, hs, m.heads});   // dk
      }
    }
    for (int i = 0; i < (batched_heads ? 0 : t.micro_batch_size * m.heads); ++i) {
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

// Floats each operand buffer needs so that every shape (and every product of a batch) fits.
struct extents {
  std::size_t a = 0, b = 0, c = 0;
};
extents buffer_extents(const std::vector<gemm_shape>& shapes) {
  extents e;
  for (const auto& s : shapes) {
    const auto last = std::size_t(s.batch - 1);
    e.a = std::max<std::size_t>(e.a, last * s.sa + std::size_t(s.ta ? s.k : s.m) * s.lda);
    e.b = std::max<std::size_t>(e.b, last * s.sb + std::size_t(s.tb ? s.n : s.k) * s.ldb);
    e.c = std::max<std::size_t>(e.c, last * s.sc + std::size_t(s.m) * s.ldc);
  }
  return e;
}

double step_flops(const std::vector<gemm_shape>& shapes, int micro_batches) {
  double f = 0.0;
  for (const auto& s : shapes) f += 2.0 * s.m * s.n * s.k * s.batch;
  return f * micro_batches;
}

int run_gpu(const model_config& m, const train_config& t, int repeats) {
  namespace cuda = moevement::models::cuda;
  if (cuda::device_count() == 0) {
    fmt::print(stderr, "bench model --device cuda: {}\n", cuda::describe_device());
    return 1;
  }
  const auto shapes = step_gemms(m, t, /*batched_heads=*/true);
  const double flops = step_flops(shapes, t.micro_batches);
  if (flops != step_flops(step_gemms(m, t), t.micro_batches)) {
    fmt::print(stderr, "bench model: the batched shapes count other FLOPs than the CPU's\n");
    return 1;
  }
  cuda::trainer tr(m, t);
  tr.train_iteration();  // warm-up
  cuda::context ctx;
  const extents ext = buffer_extents(shapes);
  const std::size_t a_max = ext.a, b_max = ext.b, c_max = ext.c;
  const auto key = make_key({42});
  std::vector<float> ha(a_max), hb(b_max);
  for (std::size_t i = 0; i < ha.size(); ++i) ha[i] = float(random_uniform(key, i) - 0.5);
  for (std::size_t i = 0; i < hb.size(); ++i) hb[i] = float(random_uniform(key, i + a_max) - 0.5);
  cuda::device_array<float> a(ctx, a_max), b(ctx, b_max), c(ctx, c_max);
  a.upload(ha);
  b.upload(hb);
  cuda::fill_zero(ctx, c.data(), c_max * sizeof(float));
  double best_step = 1e30, best_gemm = 1e30;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    tr.train_iteration();  // ends on the host: the loss and the norm come back every step
    best_step = std::min(best_step, seconds_since(t0));
    ctx.synchronize();
    t0 = std::chrono::steady_clock::now();
    for (int mb = 0; mb < t.micro_batches; ++mb) {
      for (const auto& s : shapes) {
        cuda::sgemm(ctx, s.ta, s.tb, s.m, s.n, s.k, a.data(), s.lda, b.data(), s.ldb,
                    s.ta ? 1.0f : 0.0f, c.data(), s.ldc, s.sa, s.sb, s.sc, s.batch);
      }
    }
    ctx.synchronize();
    best_gemm = std::min(best_gemm, seconds_since(t0));
  }
  const std::uint64_t h1 = tr.state_hash();
  cuda::trainer again(m, t);
  for (int r = 0; r < repeats + 1; ++r) again.train_iteration();
  const std::uint64_t h2 = again.state_hash();
  const double tokens = double(tr.tokens_per_iteration());
  fmt::print(
      "# {} on {}: {:.1f} M parameters, {} tokens per step (B={} T={} M={}), {:.2f} GFLOP of "
      "GEMM per step, best of {} steps\n",
      m.preset, cuda::describe_device(), double(m.parameter_count()) / 1e6, tokens,
      t.micro_batch_size, t.seq_len, t.micro_batches, flops / 1e9, repeats);
  fmt::print("# step {:.4f} s, the same GEMMs alone on cuBLAS {:.4f} s\n", best_step, best_gemm);
  const double ours_tps = tokens / best_step, theirs_tps = tokens / best_gemm;
  fmt::print("gpu_small_tokens_per_s: ours={:.1f} theirs={:.1f} ratio={:.3f}\n", ours_tps,
             theirs_tps, ours_tps / theirs_tps);
  const double ours_gf = flops / best_step / 1e9, theirs_gf = flops / best_gemm / 1e9;
  fmt::print("gpu_gemm_gflops: ours={:.2f} theirs={:.2f} ratio={:.3f}\n", ours_gf, theirs_gf,
             ours_gf / theirs_gf);
  fmt::print("gpu_run_to_run: ours={} theirs={} ratio={}\n", moevement::hex16(h1),
             moevement::hex16(h2), h1 == h2 ? "1 (bitwise equal)" : "0 (DIFFERENT)");
  fmt::print("state_hash={}\n", moevement::hex16(h1));
  return h1 == h2 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 3;
  bool gpu = false;
  const model_config m = preset("small");
  train_config t;
  t.micro_batches = 2;
  t.micro_batch_size = 4;
  t.seq_len = 128;
  t.blis_threads = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--device" && i + 1 < argc) {
      const std::string d = argv[++i];
      if (d != "cpu" && d != "cuda") {
        fmt::print(stderr, "bench model: --device takes cpu or cuda, got '{}'\n", d);
        return 2;
      }
      gpu = d == "cuda";
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::atoi(argv[++i]);
    } else if (a == "--micro-batch-size" && i + 1 < argc) {
      t.micro_batch_size = std::atoi(argv[++i]);
    } else if (!a.empty() && a[0] != '-') {
      repeats = std::atoi(a.c_str());  // the older positional form
    } else {
      fmt::print(stderr,
                 "usage: moevement bench model [--device cpu|cuda] [--repeats R] "
                 "[--micro-batch-size B]\n");
      return 2;
    }
  }
  if (repeats < 1 || t.micro_batch_size < 1) {
    fmt::print(stderr, "bench model: --repeats and --micro-batch-size must be at least 1\n");
    return 2;
  }
  if (gpu) return run_gpu(m, t, repeats);
  trainer tr(m, t);
  tr.train_iteration();  // warm-up: first-touch of every buffer

  const auto shapes = step_gemms(m, t);
  const double flops_step = step_flops(shapes, t.micro_batches);
  const extents ext = buffer_extents(shapes);
  const std::size_t a_max = ext.a, b_max = ext.b, c_max = ext.c;
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
