// One sparse snapshot slot of one stage replica (paper section 3.2): for the stage's operators,
// in canonical order, either the full training state (FP32 master, Adam m and v, step: the
// operator is "active" in this slot) or only the 2-byte compute weights ("frozen": its full
// state comes in a later slot of the window). Operators whose full state came in an earlier
// slot of the window are not in the slot at all (Algorithm 1's GenerateSchedule).
// Tagged (window, slot, stage, replica) and with the iteration whose start the state is at,
// plus the loss scaler state at that point (what a whole-job rollback resumes with).
//
// The slot lives as one byte buffer in its wire/disk format, so the capture writes straight
// into a preallocated buffer and replication or the durable tier ship the bytes unchanged:
//
//   "MVSNAP\0\0" u32 format_version
//   u64 window, u32 slot, i64 state_iteration, i32 stage, i32 replica
//   u8 scaler.enabled, f32 scaler.scale, i32 scaler.good_steps, i32 scaler.window
//   u32 operator count, then per operator:
//     u32 operator index, u16 name length, name bytes, u8 mode (0 active, 1 frozen), u64 numel
//     active: i64 step, f32 master[numel], f32 m[numel], f32 v[numel]
//     frozen: u64 compute byte count, compute bytes
//   u64 XXH3-64 of every byte before it (format 1 had XXH64; XXH3 inlined with AVX2 is about
//       five times as fast here, and the capture hashes every byte it copies)
// All integers and floats little-endian as the host writes them (x86-64 only, like the rest).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/stage_model.hpp"
#include "models/model.hpp"
#include "models/operator_state.hpp"

namespace moevement::recovery {

// Bytes that do not parse as a snapshot slot: corrupt, truncated or of another format.
class snapshot_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct snapshot_tag {
  std::uint64_t window = 0;
  std::uint32_t slot = 0;
  // The iteration the state is at the start of: captured after the step of state_iteration-1.
  std::int64_t state_iteration = 0;
  std::int32_t stage = 0, replica = 0;
  bool operator==(const snapshot_tag&) const = default;
};

inline constexpr std::uint32_t snapshot_format_version = 2;

// What a slot holds of one operator.
enum class capture_kind : std::uint8_t { skip, full, compute };

// Exact size of the slot for `ops` (canonical order) with kinds[i] for operator i.
std::size_t snapshot_size(std::span<const models::operator_state* const> ops,
                          std::span<const capture_kind> kinds);

// Writes the slot into `out` (exactly snapshot_size bytes: the preallocated buffer). Throws
// std::invalid_argument when the sizes disagree or an operator is not allocated.
void write_snapshot(std::span<std::byte> out, const snapshot_tag& tag,
                    const models::loss_scaler& scaler,
                    std::span<const models::operator_state* const> ops,
                    std::span<const capture_kind> kinds);

// The same slot with every tensor copied from a stage's device memory (device.state_on_device()):
// the layout is written on the host, each tensor is queued as a copy into its place (on the
// device's side stream, overlapping its compute), and the checksum is appended once they all
// landed. The same bytes write_snapshot() writes after device.sync_to_host(). The operators give
// names, sizes, modes and steps (which the device step keeps current on the host).
void write_snapshot(std::span<std::byte> out, const snapshot_tag& tag,
                    const models::loss_scaler& scaler,
                    std::span<const models::operator_state* const> ops,
                    std::span<const capture_kind> kinds, engine::device_state& device);

// One operator's entry in a parsed slot; the spans point into the slot's bytes (unaligned:
// read them with memcpy, as load_operator does).
struct snapshot_entry {
  std::uint32_t index = 0;  // position in the stage's operators()
  std::string name;
  models::op_mode mode = models::op_mode::active;  // active: full state; frozen: compute only
  std::uint64_t numel = 0;
  std::int64_t step = 0;                              // active only
  std::span<const std::byte> master, adam_m, adam_v;  // active only, numel floats each
  std::span<const std::byte> compute;                 // frozen only
};

struct snapshot_view {
  snapshot_tag tag;
  models::loss_scaler scaler;
  std::vector<snapshot_entry> entries;  // ascending operator index
  std::size_t bytes = 0;
};

// Validates (checksum first, then every length against the remaining bytes) and parses.
// Throws snapshot_error saying what is wrong; never reads out of bounds.
snapshot_view parse_snapshot(std::span<const std::byte> bytes);
// Two replicas' copies of one slot hold the same state: the same window, slot, iteration,
// stage and loss scaler, and every operator's entry bit for bit (the replica in the tag aside).
bool same_state(const snapshot_view& a, const snapshot_view& b);
// The tag alone, without the checksum (cheap: a copy checks it names what was asked for,
// e.g. that the sender's buffer was not reused under a late pull); nullopt when the bytes do
// not start like a snapshot of this format.
std::optional<snapshot_tag> read_snapshot_tag(std::span<const std::byte> bytes);

// Puts one entry into an operator of the same name and size: active -> master, m, v, step
// restored and the operator made active (compute weights re-derived); frozen -> the operator
// made frozen with the entry's compute weights. Throws snapshot_error on a mismatch.
void load_operator(const snapshot_entry& entry, models::operator_state& op);

}  // namespace moevement::recovery
