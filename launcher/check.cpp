#include "launcher/check.hpp"

#include <fmt/format.h>

#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "base/hash.hpp"
#include "build_config.hpp"
#include "models/cpu/gemm.hpp"
#include "models/cuda/device.hpp"
#include "transport/envelope.hpp"
#include "transport/ucx_context.hpp"

namespace moevement::launcher {
namespace {

std::string check_ucx() {
  // UCX itself only warns of a transport it lacks; a node without the fabric the job asks for
  // must not pass.
  if (const auto problem = transport::ucx_tls_problem(); !problem.empty()) {
    throw std::runtime_error(problem);
  }
  transport::ucx_context context;
  transport::ucx_worker worker(context);
  const auto address = worker.address();
  if (address.empty()) throw std::runtime_error("worker address is empty");
  if (worker.event_fd() < 0) throw std::runtime_error("worker has no event fd");
  return fmt::format("UCX {} context and worker up, worker address {} bytes",
                     transport::ucx_version(), address.size());
}

std::string check_envelope() {
  transport::envelope_header h{{1, 2, 3}, {4, 5, 6}, 7, 8, 9};
  transport::outgoing_envelope out(h);
  auto words = out.to_words();
  auto bytes = std::as_bytes(std::span(words.begin(), words.size()));
  auto in = transport::incoming_envelope::decode(bytes);
  if (!in.ok()) throw std::runtime_error(in.err().message);
  if (!(in->header() == h)) throw std::runtime_error("header changed on the way");
  auto truncated = transport::incoming_envelope::decode(bytes.first(bytes.size() - 8));
  if (truncated.ok()) throw std::runtime_error("a truncated envelope was accepted");
  return fmt::format("Cap'n Proto envelope round trip ({} bytes), truncation rejected",
                     bytes.size());
}

std::string check_blis() {
  // 256^3 SGEMM with 1 and 2 BLIS threads must agree bit for bit (determinism contract).
  constexpr int n = 256;
  std::vector<float> a(n * n), b(n * n);
  std::uint32_t x = 12345;
  for (auto* v : {&a, &b}) {
    for (auto& e : *v) {
      x = x * 1664525u + 1013904223u;
      e = static_cast<float>(x >> 8) / static_cast<float>(1u << 24) - 0.5f;
    }
  }
  std::vector<std::uint64_t> hashes;
  for (int threads : {1, 2}) {
    std::vector<float> c(n * n, 0.0f);
    models::cpu::set_gemm_threads(threads);
    models::cpu::sgemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    hashes.push_back(xxhash64(std::as_bytes(std::span(c))));
  }
  models::cpu::set_gemm_threads(1);
  if (hashes[0] != hashes[1]) throw std::runtime_error("BLIS SGEMM bits differ across threads");
  return fmt::format("BLIS SGEMM 256^3 bit-identical on 1 and 2 threads (xxh64 {})",
                     hex16(hashes[0]));
}

std::string check_cuda() {
  if (!models::cuda::compiled()) return "CUDA backend not compiled in (skipped)";
  const int n = models::cuda::device_count();
  if (n == 0) return "CUDA backend compiled in; no GPU visible (GPU checks skipped)";
  const auto y = models::cuda::saxpy(2.0f, {1.0f, 2.0f}, {0.5f, 0.25f});
  if (y[0] != 2.5f || y[1] != 4.25f) throw std::runtime_error("saxpy gave wrong values");
  return fmt::format("{} GPU(s); device 0 {}; saxpy kernel correct", n,
                     models::cuda::describe_device());
}

}  // namespace

int run_check(std::ostream& out) {
  const std::vector<std::pair<const char*, std::function<std::string()>>> checks = {
      {"ucx", check_ucx}, {"wire", check_envelope}, {"blis", check_blis}, {"cuda", check_cuda}};
  int failed = 0;
  out << fmt::format("moevement {} (march fixed at build, fp-contract off)\n", MOEVEMENT_VERSION);
  for (const auto& [name, fn] : checks) {
    try {
      out << fmt::format("  ok    {:5} {}\n", name, fn());
    } catch (const std::exception& e) {
      ++failed;
      out << fmt::format("  FAIL  {:5} {}\n", name, e.what());
    }
  }
  out << (failed == 0 ? "all checks passed\n" : fmt::format("{} check(s) failed\n", failed));
  return failed == 0 ? 0 : 1;
}

}  // namespace moevement::launcher
