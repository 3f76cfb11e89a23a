#include "transport/ucx_context.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ucs/debug/debug.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string_view>

namespace moevement::transport {
namespace {

void check(ucs_status_t status, const char* what) {
  if (status != UCS_OK) {
    throw std::runtime_error(
        fmt::format("{} failed: {} (check UCX_* environment variables and "
                    "`ucx_info -d` for the transports on this host)",
                    what, ucs_status_string(status)));
  }
}

// UCX_TLS's aliases (ucp_context.c), each with the transports it stands for.
const std::map<std::string_view, std::vector<std::string_view>>& tls_aliases() {
  static const std::map<std::string_view, std::vector<std::string_view>> a{
      {"sm", {"posix", "sysv", "xpmem", "knem", "cma"}},
      {"shm", {"posix", "sysv", "xpmem", "knem", "cma"}},
      {"mm", {"posix", "sysv", "xpmem"}},
      {"ib", {"rc_verbs", "rc_mlx5", "ud_verbs", "ud_mlx5", "dc_mlx5"}},
      {"rc", {"rc_verbs", "rc_mlx5"}},
      {"rc_v", {"rc_verbs"}},
      {"rc_x", {"rc_mlx5"}},
      {"ud", {"ud_verbs", "ud_mlx5"}},
      {"ud_v", {"ud_verbs"}},
      {"ud_x", {"ud_mlx5"}},
      {"dc", {"dc_mlx5"}},
      {"dc_x", {"dc_mlx5"}},
      {"cuda", {"cuda_copy", "cuda_ipc", "gdr_copy"}},
      {"rocm", {"rocm_copy", "rocm_ipc", "rocm_gdr"}},
      {"ugni", {"ugni_rdma", "ugni_udt", "ugni_smsg"}},
      {"ze", {"ze_copy"}},
  };
  return a;
}

}  // namespace

std::vector<std::string> unavailable_transports(std::string_view ucx_tls,
                                                const std::vector<std::string>& available) {
  std::vector<std::string> missing;
  if (ucx_tls.empty() || ucx_tls.front() == '^') return missing;
  const auto has = [&](std::string_view tl) {
    return std::find(available.begin(), available.end(), tl) != available.end();
  };
  std::size_t from = 0;
  while (from <= ucx_tls.size()) {
    const std::size_t comma = std::min(ucx_tls.find(',', from), ucx_tls.size());
    std::string_view name = ucx_tls.substr(from, comma - from);
    name = name.substr(0, name.find(':'));  // "ud:aux": a transport UCX uses for a side job
    from = comma + 1;
    if (name.empty() || name == "all") continue;
    const auto alias = tls_aliases().find(name);
    const bool served = alias == tls_aliases().end()
                            ? has(name)
                            : std::any_of(alias->second.begin(), alias->second.end(), has);
    if (!served) missing.emplace_back(name);
  }
  return missing;
}

std::vector<std::string> ucx_transports() {
  ucp_config_t* config = nullptr;
  check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  const ucs_status_t modified = ucp_config_modify(config, "TLS", "all");
  if (modified != UCS_OK) ucp_config_release(config);
  check(modified, "ucp_config_modify(TLS)");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA;
  ucp_context_h context = nullptr;
  const ucs_status_t status = ucp_init(&params, config, &context);
  ucp_config_release(config);
  check(status, "ucp_init");
  // Its resources, one line each: "#      resource 1  :  md 1  dev 1  flags -- tcp/lo".
  char* text = nullptr;
  std::size_t length = 0;
  FILE* out = ::open_memstream(&text, &length);
  if (out != nullptr) {
    ucp_context_print_info(context, out);
    std::fclose(out);
  }
  ucp_cleanup(context);
  std::vector<std::string> names;
  const std::string info = text != nullptr ? std::string(text, length) : std::string();
  std::free(text);
  for (std::size_t at = info.find("resource"); at != std::string::npos;
       at = info.find("resource", at + 1)) {
    const std::size_t dashes = info.find("-- ", at), end = info.find('\n', at);
    if (dashes == std::string::npos || dashes > end) continue;
    const std::string entry = info.substr(dashes + 3, end - dashes - 3);
    const std::string tl = entry.substr(0, entry.find('/'));
    if (!tl.empty() && std::find(names.begin(), names.end(), tl) == names.end()) {
      names.push_back(tl);
    }
  }
  return names;
}

std::string ucx_tls_problem() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr || *tls == '\0') return "";
  std::vector<std::string> available;
  try {
    available = ucx_transports();
  } catch (const std::exception&) {
    return "";  // nothing known to hold against it: the job's own context says what is wrong
  }
  // Nothing read (another UCX's layout of its resources): no name is judged missing.
  if (available.empty()) return "";
  const auto missing = unavailable_transports(tls, available);
  if (missing.empty()) return "";
  return fmt::format(
      "UCX_TLS={} names {}, which UCX has no transport for on this host (it has {}; `ucx_info "
      "-d` lists them)",
      tls, fmt::join(missing, ", "), fmt::join(available, ", "));
}

ucx_context::ucx_context(context_use use, bool loopback_only) {
  // UCX 1.13 drops its shared-memory transports from endpoints with peer error handling
  // unless these are set (same-host traffic then falls to TCP, ~10x slower). They configure
  // UCT memory domains, which only the environment reaches (ucp_config_modify does not), so
  // they are set there before the context reads it; an explicit setting wins, and they are
  // left out where UCX_TLS excludes shared memory (UCX would warn that they are unused).
  const char* tls = std::getenv("UCX_TLS");
  const std::string t = tls != nullptr ? tls : "";
  const bool shm_possible = t.empty() || t[0] == '^' || t.find("sm") != std::string::npos ||
                            t.find("posix") != std::string::npos ||
                            t.find("sysv") != std::string::npos ||
                            t.find("all") != std::string::npos;
  if (shm_possible) {
    ::setenv("UCX_POSIX_ERROR_HANDLING", "y", /*overwrite=*/0);
    ::setenv("UCX_SYSV_ERROR_HANDLING", "y", /*overwrite=*/0);
  }
  // UCX's TCP transport connects its sockets blocking by default: a dropped SYN then stops
  // this process's only io thread for Linux's 1 s retry (3 s for two), its heartbeats with it,
  // and its peers declared it lost (4 of 4 launches with 30% of SYNs dropped). Non-blocking,
  // the connection is simply late (tests/launcher/network_faults_test).
  const bool tcp_possible = t.empty() || t[0] == '^' || t.find("tcp") != std::string::npos ||
                            t.find("all") != std::string::npos;
  if (tcp_possible) ::setenv("UCX_TCP_CONN_NB", "y", /*overwrite=*/0);
  ucp_config_t* config = nullptr;
  check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  if (use == context_use::messages && t.empty()) {
    const ucs_status_t s = ucp_config_modify(config, "TLS", "^mm");
    if (s != UCS_OK) ucp_config_release(config);
    check(s, "ucp_config_modify(TLS)");
  }
  // NET_DEVICES is a UCP setting (ucp_config_modify reaches it); shared-memory and self
  // devices are not network devices and stay as they are.
  if (loopback_only && std::getenv("UCX_NET_DEVICES") == nullptr) {
    const ucs_status_t s = ucp_config_modify(config, "NET_DEVICES", "lo");
    if (s != UCS_OK) ucp_config_release(config);
    check(s, "ucp_config_modify(NET_DEVICES)");
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;  // one worker, driven from one thread
  const ucs_status_t status = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  check(status, "ucp_init");
}

void release_hangup_signal() {
  if (std::getenv("UCX_DEBUG_SIGNO") == nullptr) ucs_debug_disable_signal(SIGHUP);
}

ucx_context::~ucx_context() {
  if (context_ != nullptr) ucp_cleanup(context_);
}

ucx_worker::ucx_worker(const ucx_context& context) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_EVENTS;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  // Wake up for arriving data only. With send completions among the wakeup events (the
  // default), UCX 1.13 refuses to arm (UCS_ERR_BUSY) while any send waits in a shared-memory
  // transport's pending queue, UCX's own included: the flush that discards the endpoint to a
  // peer that hung with its FIFO full and then died waits there for ever, so the worker could
  // never sleep again (ucx_link spun, every survivor at 100% CPU). ucx_link progresses
  // requests in flight from a poll timer anyway (transport/ucx_link.cpp, pump()).
  params.events = UCP_WAKEUP_RX;
  check(ucp_worker_create(context.handle(), &params, &worker_), "ucp_worker_create");
}

ucx_worker::~ucx_worker() {
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
}

int ucx_worker::event_fd() const {
  int fd = -1;
  check(ucp_worker_get_efd(worker_, &fd), "ucp_worker_get_efd");
  return fd;
}

unsigned ucx_worker::progress() {
  return ucp_worker_progress(worker_);
}

std::vector<std::byte> ucx_worker::address() const {
  ucp_address_t* addr = nullptr;
  std::size_t len = 0;
  check(ucp_worker_get_address(worker_, &addr, &len), "ucp_worker_get_address");
  std::vector<std::byte> out(len);
  std::memcpy(out.data(), addr, len);
  ucp_worker_release_address(worker_, addr);
  return out;
}

std::string ucx_version() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return fmt::format("{}.{}.{}", major, minor, release);
}

}  // namespace moevement::transport
