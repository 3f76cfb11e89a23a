// The replicas of a GPU stage sum their gradients through NCCL, device to device, with the
// host path's bits (engine/stage_actor.cpp): a chain in replica order. Rank 0 sends its
// gradients to rank 1, which adds its own (one IEEE addition per element, acc = g_1 + g_0,
// what the host's accumulate() computes) and sends the sum to rank 2, and so on; the last rank
// then broadcasts the total. Point-to-point sends and a broadcast only copy bytes, so the
// result does not depend on NCCL's algorithm, protocol or channel count.
//
// Non-blocking throughout: the communicator is made with blocking = 0 and every wait polls
// NCCL's asynchronous error and the stream, so that a peer that never comes is a timeout and a
// dead or hung one is an abort (ncclCommAbort, which never waits on a peer), never a hang.
// Built when CUDA is found; without it every entry point throws (collectives_stub.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "models/cuda/kernels.hpp"

namespace moevement::models::cuda {

// ncclUniqueId's size: the bytes a group's members must all be given.
inline constexpr std::size_t group_id_bytes = 128;

// A new group id (ncclGetUniqueId: NCCL's bootstrap root then listens in this process, on the
// interface NCCL_SOCKET_IFNAME names, until the group has formed).
std::vector<std::byte> new_group_id();

// How a wait ended.
enum class wait_end : std::uint8_t {
  done,       // formed / summed
  stopped,    // `stop` was set: the communicator was aborted
  timed_out,  // the deadline passed first: aborted
  failed,     // NCCL or CUDA reported an error (a peer's socket closed, say): aborted
};
struct wait_result {
  wait_end end = wait_end::done;
  std::string error;     // what NCCL or CUDA said (failed), or what was waited for
  double seconds = 0.0;  // spent in the call
};

class nccl_group {
 public:
  using clock = std::chrono::steady_clock;
  // Starts joining group `id` as `rank` of `ranks` on ctx's device and returns at once: the
  // group forms in NCCL's background threads once every rank has joined. Throws on a bad
  // id or rank, or when NCCL refuses at once.
  nccl_group(context& ctx, std::span<const std::byte> id, int ranks, int rank);
  ~nccl_group();  // aborts the communicator if it is still alive
  nccl_group(const nccl_group&) = delete;
  nccl_group& operator=(const nccl_group&) = delete;

  int rank() const { return rank_; }
  int ranks() const { return ranks_; }
  // Whether the communicator can still be used (formed or forming, never aborted).
  bool alive() const { return comm_ != nullptr; }

  // Waits until every rank has joined (the first call after the constructor), until
  // `deadline`, or until `stop` is set.
  wait_result wait_formed(clock::time_point deadline, const std::atomic<bool>& stop);
  // The chain sum of the header over `grads` (device buffers, the same sizes in the same order
  // on every rank; empty ones are skipped): every rank's buffers hold the total when it
  // returns done. Queued on ctx's stream after whatever is there (the backward); waits for it
  // with no deadline (a slow peer is not a failure), until `stop` is set.
  wait_result sum(std::span<const std::span<float>> grads, const std::atomic<bool>& stop);
  // ncclCommAbort: returns without waiting on any peer; the group cannot be used again.
  // Returns the abort's seconds (an earlier abort's, where a wait already aborted it).
  double abort();

 private:
  wait_result wait_queued(const std::atomic<bool>& stop, clock::time_point deadline, bool stream);

  context& ctx_;
  int ranks_ = 0, rank_ = 0;
  void* comm_ = nullptr;                          // ncclComm_t
  std::unique_ptr<device_array<float>> scratch_;  // rank > 0: the partial sum received
  clock::time_point joined_;
  double abort_s_ = 0.0;
};

}  // namespace moevement::models::cuda
