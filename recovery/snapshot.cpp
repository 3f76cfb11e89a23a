#include "recovery/snapshot.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>

#include "base/hash.hpp"
#include "models/tensor.hpp"

namespace moevement::recovery {
namespace {

constexpr std::array<char, 8> magic = {'M', 'V', 'S', 'N', 'A', 'P', '\0', '\0'};
// magic, version, tag (8+4+8+4+4), scaler (1+4+4+4), operator count
constexpr std::size_t header_bytes = 8 + 4 + 28 + 13 + 4;
constexpr std::size_t checksum_bytes = 8;

std::size_t entry_size(const models::operator_state& op, capture_kind kind) {
  const auto numel = std::size_t(op.numel());
  std::size_t n = 4 + 2 + op.name().size() + 1 + 8;
  if (kind == capture_kind::full) {
    n += 8 + 3 * numel * sizeof(float);
  } else {
    n += 8 + op.compute_bytes().size();
  }
  return n;
}

// Writes a slot front to back and hashes it as it goes: each block is hashed while it is
// still in cache, not read back from memory afterwards (XXH3's digest does not depend on how
// the bytes are split).
class writer {
 public:
  // deferred: nothing is hashed while writing (the tensors arrive later, by device copies
  // into reserve()d places); finish() then hashes the whole slot at once.
  explicit writer(std::span<std::byte> out, bool deferred = false)
      : out_(out), deferred_(deferred) {}
  std::span<std::byte> reserve(std::size_t n) {
    if (!deferred_) throw std::logic_error("snapshot: reserve() needs a deferred writer");
    if (n > out_.size() - at_) throw std::invalid_argument("snapshot: buffer too small");
    const auto r = out_.subspan(at_, n);
    at_ += n;
    return r;
  }
  void bytes(const void* p, std::size_t n) {
    if (n > out_.size() - at_) throw std::invalid_argument("snapshot: buffer too small");
    const auto* from = static_cast<const std::byte*>(p);
    while (n > 0) {
      const std::size_t piece = std::min(n, hash_block);
      std::memcpy(out_.data() + at_, from, piece);
      at_ += piece;
      from += piece;
      n -= piece;
      if (!deferred_ && at_ - hashed_ >= hash_block) hash_written();
    }
  }
  template <class T>
  void value(T v) {
    bytes(&v, sizeof v);
  }
  // Appends the checksum of everything written before it.
  void finish() {
    hash_written();
    const std::uint64_t sum = hash_.digest();
    if (sizeof sum > out_.size() - at_) throw std::invalid_argument("snapshot: buffer too small");
    std::memcpy(out_.data() + at_, &sum, sizeof sum);
    at_ += sizeof sum;
    hashed_ = at_;
  }
  std::size_t at() const { return at_; }

 private:
  static constexpr std::size_t hash_block = 256u << 10;  // fits in a core's L2
  void hash_written() {
    hash_.update(out_.subspan(hashed_, at_ - hashed_));
    hashed_ = at_;
  }
  std::span<std::byte> out_;
  bool deferred_;
  std::size_t at_ = 0, hashed_ = 0;
  xxh3_hasher hash_;
};

class reader {
 public:
  explicit reader(std::span<const std::byte> in) : in_(in) {}
  std::span<const std::byte> take(std::size_t n, const char* what) {
    if (n > in_.size() - at_) {
      throw snapshot_error("snapshot truncated: " + std::string(what) + " needs " +
                           std::to_string(n) + " bytes at offset " + std::to_string(at_) +
                           ", only " + std::to_string(in_.size() - at_) + " left");
    }
    auto s = in_.subspan(at_, n);
    at_ += n;
    return s;
  }
  template <class T>
  T value(const char* what) {
    T v;
    std::memcpy(&v, take(sizeof v, what).data(), sizeof v);
    return v;
  }
  std::size_t left() const { return in_.size() - at_; }

 private:
  std::span<const std::byte> in_;
  std::size_t at_ = 0;
};

void require_sizes(std::span<const models::operator_state* const> ops,
                   std::span<const capture_kind> kinds) {
  if (ops.size() != kinds.size()) {
    throw std::invalid_argument("snapshot: " + std::to_string(kinds.size()) + " kinds for " +
                                std::to_string(ops.size()) + " operators");
  }
}

}  // namespace

std::size_t snapshot_size(std::span<const models::operator_state* const> ops,
                          std::span<const capture_kind> kinds) {
  require_sizes(ops, kinds);
  std::size_t n = header_bytes + checksum_bytes;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (kinds[i] != capture_kind::skip) n += entry_size(*ops[i], kinds[i]);
  }
  return n;
}

namespace {
// write_snapshot's body. The tensors of operator i go through put(i, tensor, bytes) (host:
// written in place; device: a copy queued into a reserved place).
template <class Put>
void write_slot(writer& w, std::span<std::byte> out, const snapshot_tag& tag,
                const models::loss_scaler& scaler,
                std::span<const models::operator_state* const> ops,
                std::span<const capture_kind> kinds, Put&& put) {
  if (out.size() != snapshot_size(ops, kinds)) {
    throw std::invalid_argument("snapshot: buffer of " + std::to_string(out.size()) +
                                " bytes, the slot needs " +
                                std::to_string(snapshot_size(ops, kinds)));
  }
  w.bytes(magic.data(), magic.size());
  w.value(snapshot_format_version);
  w.value(tag.window);
  w.value(tag.slot);
  w.value(tag.state_iteration);
  w.value(tag.stage);
  w.value(tag.replica);
  w.value(std::uint8_t(scaler.enabled ? 1 : 0));
  w.value(scaler.scale);
  w.value(scaler.good_steps);
  w.value(scaler.window);
  std::uint32_t count = 0;
  for (auto k : kinds) count += k != capture_kind::skip ? 1 : 0;
  w.value(count);
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (kinds[i] == capture_kind::skip) continue;
    const models::operator_state& op = *ops[i];
    if (!op.allocated()) throw std::invalid_argument("snapshot: operator " + op.name() + " freed");
    if (op.name().size() > std::numeric_limits<std::uint16_t>::max()) {
      throw std::invalid_argument("snapshot: operator name too long: " + op.name());
    }
    w.value(std::uint32_t(i));
    w.value(std::uint16_t(op.name().size()));
    w.bytes(op.name().data(), op.name().size());
    w.value(std::uint8_t(kinds[i] == capture_kind::full ? 0 : 1));
    w.value(std::uint64_t(op.numel()));
    using tensor = engine::device_state::tensor;
    if (kinds[i] == capture_kind::full) {
      w.value(op.step());
      const std::size_t bytes = std::size_t(op.numel()) * sizeof(float);
      for (auto t : {tensor::master, tensor::adam_m, tensor::adam_v}) put(i, t, bytes);
    } else {
      w.value(std::uint64_t(op.compute_bytes().size()));
      put(i, tensor::compute, op.compute_bytes().size());
    }
  }
}
}  // namespace

void write_snapshot(std::span<std::byte> out, const snapshot_tag& tag,
                    const models::loss_scaler& scaler,
                    std::span<const models::operator_state* const> ops,
                    std::span<const capture_kind> kinds) {
  writer w(out);
  write_slot(w, out, tag, scaler, ops, kinds,
             [&](std::size_t i, engine::device_state::tensor t, std::size_t) {
               const models::operator_state& op = *ops[i];
               using tensor = engine::device_state::tensor;
               const auto b = t == tensor::master   ? std::as_bytes(op.master())
                              : t == tensor::adam_m ? std::as_bytes(op.adam_m())
                              : t == tensor::adam_v ? std::as_bytes(op.adam_v())
                                                    : op.compute_bytes();
               w.bytes(b.data(), b.size());
             });
  w.finish();
}

void write_snapshot(std::span<std::byte> out, const snapshot_tag& tag,
                    const models::loss_scaler& scaler,
                    std::span<const models::operator_state* const> ops,
                    std::span<const capture_kind> kinds, engine::device_state& device) {
  writer w(out, /*deferred=*/true);
  try {
    write_slot(w, out, tag, scaler, ops, kinds,
               [&](std::size_t i, engine::device_state::tensor t, std::size_t bytes) {
                 device.copy_out(i, t, w.reserve(bytes));
               });
  } catch (...) {
    device.wait_copies();  // none may land in the buffer after the caller reuses it
    throw;
  }
  device.wait_copies();
  w.finish();
}

namespace {
// The tag fields, in header order (after the magic and the format version).
snapshot_tag read_tag(reader& r) {
  snapshot_tag t;
  t.window = r.value<std::uint64_t>("window");
  t.slot = r.value<std::uint32_t>("slot");
  t.state_iteration = r.value<std::int64_t>("iteration");
  t.stage = r.value<std::int32_t>("stage");
  t.replica = r.value<std::int32_t>("replica");
  return t;
}
}  // namespace

std::optional<snapshot_tag> read_snapshot_tag(std::span<const std::byte> bytes) {
  if (bytes.size() < header_bytes + checksum_bytes ||
      std::memcmp(bytes.data(), magic.data(), magic.size()) != 0) {
    return std::nullopt;
  }
  reader r(bytes.first(header_bytes));
  r.take(magic.size(), "magic");
  if (r.value<std::uint32_t>("format version") != snapshot_format_version) return std::nullopt;
  return read_tag(r);
}

snapshot_view parse_snapshot(std::span<const std::byte> bytes) {
  if (bytes.size() < header_bytes + checksum_bytes) {
    throw snapshot_error("snapshot truncated: " + std::to_string(bytes.size()) +
                         " bytes is less than a header");
  }
  const auto body = bytes.first(bytes.size() - checksum_bytes);
  std::uint64_t stored = 0;
  std::memcpy(&stored, bytes.data() + body.size(), sizeof stored);
  if (std::memcmp(bytes.data(), magic.data(), magic.size()) != 0) {
    throw snapshot_error("not a snapshot slot (bad magic)");
  }
  // The version before the checksum: another version's checksum is another hash.
  std::uint32_t version = 0;
  std::memcpy(&version, bytes.data() + magic.size(), sizeof version);
  if (version != snapshot_format_version) {
    throw snapshot_error("snapshot format version " + std::to_string(version) + ", expected " +
                         std::to_string(snapshot_format_version) +
                         ": written by another version of moevement");
  }
  if (xxh3_64(body) != stored) {
    throw snapshot_error("snapshot checksum mismatch (corrupt or truncated slot of " +
                         std::to_string(bytes.size()) + " bytes): fetch another copy");
  }
  reader r(body);
  r.take(magic.size(), "magic");
  (void)r.value<std::uint32_t>("format version");
  snapshot_view v;
  v.bytes = bytes.size();
  v.tag = read_tag(r);
  v.scaler.enabled = r.value<std::uint8_t>("scaler") != 0;
  v.scaler.scale = r.value<float>("scaler");
  v.scaler.good_steps = r.value<std::int32_t>("scaler");
  v.scaler.window = r.value<std::int32_t>("scaler");
  const auto count = r.value<std::uint32_t>("operator count");
  for (std::uint32_t k = 0; k < count; ++k) {
    snapshot_entry e;
    e.index = r.value<std::uint32_t>("operator index");
    if (!v.entries.empty() && e.index <= v.entries.back().index) {
      throw snapshot_error("snapshot operators out of order at entry " + std::to_string(k));
    }
    const auto name_len = r.value<std::uint16_t>("name length");
    const auto name = r.take(name_len, "name");
    e.name.assign(reinterpret_cast<const char*>(name.data()), name.size());
    const auto mode = r.value<std::uint8_t>("mode");
    if (mode > 1) throw snapshot_error("snapshot operator " + e.name + ": bad mode");
    e.mode = mode == 0 ? models::op_mode::active : models::op_mode::frozen;
    e.numel = r.value<std::uint64_t>("numel");
    if (e.numel > r.left()) {  // every element takes at least one byte
      throw snapshot_error("snapshot operator " + e.name + ": numel " + std::to_string(e.numel) +
                           " exceeds the slot");
    }
    if (e.mode == models::op_mode::active) {
      e.step = r.value<std::int64_t>("step");
      const std::size_t n = std::size_t(e.numel) * sizeof(float);
      e.master = r.take(n, "master");
      e.adam_m = r.take(n, "adam m");
      e.adam_v = r.take(n, "adam v");
    } else {
      const auto n = r.value<std::uint64_t>("compute length");
      e.compute = r.take(std::size_t(std::min<std::uint64_t>(n, r.left() + 1)), "compute");
    }
    v.entries.push_back(std::move(e));
  }
  if (r.left() != 0) {
    throw snapshot_error("snapshot has " + std::to_string(r.left()) + " trailing bytes");
  }
  return v;
}

void load_operator(const snapshot_entry& entry, models::operator_state& op) {
  if (entry.name != op.name() || entry.numel != std::uint64_t(op.numel())) {
    throw snapshot_error("snapshot entry " + entry.name + " (" + std::to_string(entry.numel) +
                         " parameters) does not fit operator " + op.name() + " (" +
                         std::to_string(op.numel()) + "): the snapshot is of another model");
  }
  if (entry.mode == models::op_mode::active) {
    std::memcpy(op.master().data(), entry.master.data(), entry.master.size());
    std::memcpy(op.adam_m().data(), entry.adam_m.data(), entry.adam_m.size());
    std::memcpy(op.adam_v().data(), entry.adam_v.data(), entry.adam_v.size());
    op.set_step(entry.step);
    op.set_mode(models::op_mode::active);
    op.refresh_compute();
  } else {
    if (entry.compute.size() != op.compute_bytes().size()) {
      throw snapshot_error("snapshot entry " + entry.name + ": " +
                           std::to_string(entry.compute.size()) + " compute bytes, operator has " +
                           std::to_string(op.compute_bytes().size()));
    }
    op.set_mode(models::op_mode::frozen);
    op.set_compute_bytes(entry.compute);
  }
}

bool same_state(const snapshot_view& a, const snapshot_view& b) {
  const auto equal = [](std::span<const std::byte> x, std::span<const std::byte> y) {
    return std::equal(x.begin(), x.end(), y.begin(), y.end());
  };
  if (a.tag.window != b.tag.window || a.tag.slot != b.tag.slot ||
      a.tag.state_iteration != b.tag.state_iteration || a.tag.stage != b.tag.stage ||
      a.scaler.enabled != b.scaler.enabled || a.scaler.scale != b.scaler.scale ||
      a.scaler.good_steps != b.scaler.good_steps || a.entries.size() != b.entries.size()) {
    return false;
  }
  for (std::size_t i = 0; i < a.entries.size(); ++i) {
    const auto &x = a.entries[i], &y = b.entries[i];
    if (x.index != y.index || x.name != y.name || x.mode != y.mode || x.numel != y.numel ||
        x.step != y.step || !equal(x.master, y.master) || !equal(x.adam_m, y.adam_m) ||
        !equal(x.adam_v, y.adam_v) || !equal(x.compute, y.compute)) {
      return false;
    }
  }
  return true;
}

}  // namespace moevement::recovery
