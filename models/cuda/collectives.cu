#include "models/cuda/collectives.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <stdexcept>
#include <thread>

namespace moevement::models::cuda {
namespace {

ncclComm_t as_comm(void* p) {
  return static_cast<ncclComm_t>(p);
}

std::string nccl_message(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') s += std::string(" (") + last + ")";
  return s;
}

double seconds_since(nccl_group::clock::time_point t0) {
  return std::chrono::duration<double>(nccl_group::clock::now() - t0).count();
}

static_assert(sizeof(ncclUniqueId) == group_id_bytes);

}  // namespace

std::vector<std::byte> new_group_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    throw std::runtime_error("ncclGetUniqueId: " + nccl_message(r, nullptr) +
                             "; NCCL_SOCKET_IFNAME names the interface it listens on");
  }
  std::vector<std::byte> out(sizeof id);
  std::memcpy(out.data(), &id, sizeof id);
  return out;
}

nccl_group::nccl_group(context& ctx, std::span<const std::byte> id, int ranks, int rank)
    : ctx_(ctx), ranks_(ranks), rank_(rank) {
  if (id.size() != group_id_bytes) {
    throw std::invalid_argument("nccl_group: a group id has " + std::to_string(group_id_bytes) +
                                " bytes, got " + std::to_string(id.size()));
  }
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    throw std::invalid_argument("nccl_group: rank " + std::to_string(rank) + " of " +
                                std::to_string(ranks));
  }
  ctx.get();  // the context's device current on this thread: the communicator's device
  ncclUniqueId uid;
  std::memcpy(&uid, id.data(), sizeof uid);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;  // returns at once; forming is polled (wait_formed), never waited out
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, ranks, uid, rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string why = nccl_message(r, comm);
    if (comm != nullptr) (void)ncclCommAbort(comm);
    throw std::runtime_error("ncclCommInitRankConfig: " + why);
  }
  comm_ = comm;
  joined_ = clock::now();
}

nccl_group::~nccl_group() {
  (void)abort();
}

double nccl_group::abort() {
  if (comm_ == nullptr) return abort_s_;
  const auto t0 = clock::now();
  ctx_.get();
  (void)ncclCommAbort(as_comm(comm_));
  comm_ = nullptr;
  abort_s_ = seconds_since(t0);
  return abort_s_;
}

wait_result nccl_group::wait_queued(const std::atomic<bool>& stop, clock::time_point deadline,
                                    bool stream) {
  const auto t0 = clock::now();
  if (comm_ == nullptr) return {wait_end::failed, "the group was aborted", 0.0};
  auto s = static_cast<cudaStream_t>(ctx_.stream());
  for (int polls = 0;; ++polls) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(as_comm(comm_), &state);
    if (r != ncclSuccess) state = r;
    if (state != ncclSuccess && state != ncclInProgress) {
      std::string why = "NCCL: " + nccl_message(state, as_comm(comm_));
      (void)abort();
      return {wait_end::failed, std::move(why), seconds_since(t0)};
    }
    if (state == ncclSuccess) {
      if (!stream) return {wait_end::done, {}, seconds_since(t0)};
      const cudaError_t q = cudaStreamQuery(s);
      if (q == cudaSuccess) return {wait_end::done, {}, seconds_since(t0)};
      if (q != cudaErrorNotReady) {
        (void)cudaGetLastError();
        (void)abort();
        return {wait_end::failed, std::string("CUDA: ") + cudaGetErrorString(q), seconds_since(t0)};
      }
    }
    if (stop.load(std::memory_order_relaxed)) {
      (void)abort();
      return {wait_end::stopped, "stopped", seconds_since(t0)};
    }
    if (clock::now() >= deadline) {
      (void)abort();
      return {wait_end::timed_out, "deadline", seconds_since(t0)};
    }
    // Spin briefly (a reduction is milliseconds), then poll at 0.1 ms.
    if (polls < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

wait_result nccl_group::wait_formed(clock::time_point deadline, const std::atomic<bool>& stop) {
  wait_result r = wait_queued(stop, deadline, false);
  r.seconds = seconds_since(joined_);
  if (r.end == wait_end::timed_out) {
    r.error = "the group of " + std::to_string(ranks_) +
              " replicas did not form before the deadline (a replica never joined)";
  }
  return r;
}

wait_result nccl_group::sum(std::span<const std::span<float>> grads,
                            const std::atomic<bool>& stop) {
  const auto t0 = clock::now();
  if (comm_ == nullptr) return {wait_end::failed, "the group was aborted", 0.0};
  if (ranks_ == 1) return {wait_end::done, {}, 0.0};
  ctx_.get();
  auto s = static_cast<cudaStream_t>(ctx_.stream());
  auto comm = as_comm(comm_);
  std::size_t total = 0;
  for (const auto& g : grads) total += g.size();
  if (rank_ > 0 && (!scratch_ || scratch_->size() < total)) {
    scratch_ = std::make_unique<device_array<float>>(ctx_, total);
  }
  const auto never = clock::time_point::max();
  // One NCCL group per phase; in non-blocking mode each is queued in the background, and the
  // next call on the communicator waits until it has been (ncclCommGetAsyncError: success).
  auto queue = [&](auto&& calls) -> wait_result {
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess) r = calls();
    const ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess || r == ncclInProgress) r = end;
    if (r != ncclSuccess && r != ncclInProgress) {
      std::string why = "NCCL: " + nccl_message(r, comm);
      (void)abort();
      return {wait_end::failed, std::move(why), 0.0};
    }
    return wait_queued(stop, never, false);
  };
  auto each = [&](auto&& call) -> ncclResult_t {
    std::size_t offset = 0;
    for (const auto& g : grads) {
      if (!g.empty()) {
        const ncclResult_t r = call(g, offset);
        if (r != ncclSuccess && r != ncclInProgress) return r;
      }
      offset += g.size();
    }
    return ncclSuccess;
  };
  wait_result w;
  if (rank_ > 0) {
    w = queue([&] {
      return each([&](std::span<float> g, std::size_t off) {
        return ncclRecv(scratch_->data() + off, g.size(), ncclFloat, rank_ - 1, comm, s);
      });
    });
    if (w.end != wait_end::done) return w;
    // acc = g_rank + (g_0 + ... + g_{rank-1}): one rounding per element, the host's bits
    std::size_t offset = 0;
    for (const auto& g : grads) {
      add(ctx_, g.data(), g.data(), scratch_->data() + offset, long(g.size()));
      offset += g.size();
    }
  }
  if (rank_ < ranks_ - 1) {
    w = queue([&] {
      return each([&](std::span<float> g, std::size_t) {
        return ncclSend(g.data(), g.size(), ncclFloat, rank_ + 1, comm, s);
      });
    });
    if (w.end != wait_end::done) return w;
  }
  w = queue([&] {
    return each([&](std::span<float> g, std::size_t) {
      return ncclBroadcast(g.data(), g.data(), g.size(), ncclFloat, ranks_ - 1, comm, s);
    });
  });
  if (w.end != wait_end::done) return w;
  w = wait_queued(stop, never, true);
  w.seconds = seconds_since(t0);
  return w;
}

}  // namespace moevement::models::cuda
