// What peers may ask of policy moevement's actors, and how much memory and time they may take.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace moevement::recovery {

// Limits on what peers may ask of these actors (everything from the wire is untrusted). The
// one place these defaults live.
struct policy_limits {
  std::uint64_t max_slot_bytes = std::uint64_t(4) << 30;  // one snapshot slot
  std::uint64_t max_log_bytes = std::uint64_t(8) << 30;   // one FetchLog answer
  std::size_t max_log_leases = 16;                        // FetchLog answers not yet released
  std::uint64_t bandwidth_sample_bytes = 16u << 20;       // snapshot bytes timed for Algorithm 1
  int bandwidth_samples = 5;  // copies of that sample timed; the fastest counts
  // Large pulls go in pieces of this size, one after the other, so that the processes' event
  // loops (heartbeats) are never held by one huge transfer.
  std::uint64_t pull_chunk_bytes = 8u << 20;
  // A stage offers its captured slots to the replicators together (one StoreSlots each) once
  // this many bytes wait or its window's last slot is captured: on a small model a slot's
  // messages, not its bytes, are the cost (docs/benchmark-notes.md, "Where the tiny job's
  // overhead goes"); a large slot still goes at once. At most max_store_batch slots a message.
  std::uint64_t store_batch_bytes = 4u << 20;
  // A boundary tensor at least this large is copied into the upstream log off the compute
  // thread (log_copier); a smaller one costs less to copy there than to hand over (waking the
  // capture thread: tiny's 32 KiB sends took 39 us each handed over, 22 us copied).
  std::size_t log_copy_async_bytes = 64u << 10;
  std::size_t max_store_batch = 1024;
  std::size_t max_snapshot_targets = 256;  // replicators one SnapshotTargets may name
  // Windows a stage holds at most (the persisted one, one complete and being replicated, the
  // one being captured): a step that would start another waits (a stall) until the job
  // persisted one more, at most checkpoint.max_window_wait_ms, so that host memory stays
  // bounded when replication falls behind.
  std::size_t max_windows_held = 3;
  // Windows of counts or schedules a survivor's schedule state may carry (it holds two).
  std::size_t max_schedule_windows = 8;
  // How long a parallel group replay waits for a peer's gradients of one iteration. A peer
  // that died or hangs is found by the heartbeats first (the region then restarts under a
  // newer generation, whose ReplayGeneration ends this wait); this only bounds a wait nothing
  // else ends.
  std::chrono::seconds group_wait{600};
  // Whether a replicator flips the bit a StoreSlot names in its copy (`--inject
  // flip:...,target=slot`). Off unless the job was launched with such a flip: from the wire
  // alone, any member could otherwise corrupt another's copies.
  bool accept_copy_flips = false;
};

}  // namespace moevement::recovery
