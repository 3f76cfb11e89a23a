// Policy moevement's replicator (one per worker, spares included): holds peers' snapshot slots
// in host memory (one persisted window and the ones in flight), pulling each through a
// slot_puller or mapping it where the owner shares its memory on this host, serves them
// (FetchSlot), and answers which durable windows verify (DurableQuery).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>

#include "engine/checkpoint.hpp"
#include "recovery/durable_window.hpp"
#include "recovery/policy_limits.hpp"
#include "recovery/recovery.capnp.h"
#include "recovery/replication_cpu.hpp"
#include "transport/shared_memory.hpp"

namespace moevement::recovery {

// How a snapshot slot is named on the wire.
void write_slot_key(wire::SlotKey::Builder b, int stage, int replica, std::uint64_t window,
                    std::uint32_t slot);

class replicator : public actors::actor {
 public:
  using interface =
      actors::interface<actors::tell_t<wire::StoreSlot>, actors::tell_t<wire::StoreSlots>,
                        actors::ask_t<wire::FetchSlot, wire::SlotData>,
                        actors::tell_t<engine::wire::WindowPersisted>,
                        actors::ask_t<engine::wire::DurableQuery, engine::wire::DurableOffer>>;

  // durable: the process's durable writer (null: the tier is off), root: checkpoint.dir.
  // share: map a slot offered by an agent on this host instead of pulling a copy.
  // cpu: where its handlers' CPU time is added (null: not measured).
  replicator(engine::bulk_io& io, policy_limits limits,
             std::shared_ptr<durable_writer> durable = nullptr, std::filesystem::path root = {},
             bool share = false, std::shared_ptr<replication_cpu> cpu = nullptr);
  std::size_t bytes_held() const;
  std::size_t flips_pending() const { return flips_.size(); }  // injected, not yet applied
  using key = std::tuple<std::int32_t, std::int32_t, std::uint64_t, std::uint32_t>;
  // A slot_puller's result: keep the slot (unless the window went meanwhile, or the job
  // restarted from disk since the pull began: `timeline` is the one it began in) and answer.
  void finish_store(const key& id, const actors::actor_ref& from,
                    const std::shared_ptr<transport::bulk_region>& holder, std::uint64_t length,
                    const std::string& error, std::uint64_t timeline);

 private:
  // What a replicator answers for one offered slot (SlotStored), to the agent `from`.
  struct store_answer {
    actors::actor_ref from;
    key id;
    bool ok = false, mapped = false;
    std::string error;
  };
  asio::awaitable<void> store(wire::StoreSlot::Reader m);
  asio::awaitable<void> store_all(wire::StoreSlots::Reader m);
  // Takes one offered slot: the answer when it is known at once (refused, or mapped); none
  // when a slot_puller answers once it pulled, or the offer names no one to answer.
  std::optional<store_answer> offer(wire::StoreSlot::Reader m);
  // The answers, one message per agent (a SlotsStored where it has several).
  void answer(const std::vector<store_answer>& answers);
  asio::awaitable<void> fetch(wire::FetchSlot::Reader m, wire::SlotData::Builder out);
  asio::awaitable<void> persisted(engine::wire::WindowPersisted::Reader m);
  // Which durable windows of a stage replica verify (the writer drained first).
  asio::awaitable<void> durable_query(engine::wire::DurableQuery::Reader m,
                                      engine::wire::DurableOffer::Builder out);

  engine::bulk_io& io_;
  policy_limits limits_;
  std::shared_ptr<durable_writer> durable_;
  std::filesystem::path root_;
  bool share_ = false;
  std::shared_ptr<replication_cpu> cpu_;
  struct stored_slot {
    transport::bulk_region region;  // a spare region may be larger than the slot
    std::uint64_t length = 0;
    // Or the owner's memory, mapped (checkpoint.share_memory): [offset, offset + length).
    std::shared_ptr<transport::shared_memory> mapped;
    std::tuple<std::int32_t, std::uint64_t, std::uint64_t> file{};  // its files_ key
    std::uint64_t offset = 0;
    transport::bulk_region exported;  // of the mapped bytes, made for the first pull of them
  };
  // Maps a slot an agent on this host offers; none: pull it instead.
  std::optional<store_answer> store_mapped(const key& id, const actors::actor_ref& from,
                                           wire::StoreSlot::Reader m, std::uint64_t length);
  std::map<key, stored_slot> slots_;
  // The owners' memory files mapped (owner pid, device, inode): those of the slots held and of
  // the window dropped last. An owner reuses its slots' files window after window, so a slot
  // offered again in one is taken with no open, map and unmap (on a small model those system
  // calls were a slot's cost); a file stays mapped at most one window after its last slot
  // went. While mapped, its inode cannot name another file.
  std::map<std::tuple<std::int32_t, std::uint64_t, std::uint64_t>,
           std::shared_ptr<transport::shared_memory>>
      files_;
  // Failure injection (StoreSlot.flipBit): the bit to flip in a pulled copy once stored.
  std::map<key, std::uint64_t> flips_;
  // The regions of the last dropped window, by length: the next window's slots have the same
  // sizes (the schedule repeats), and a fresh region costs a page fault per page on the actor
  // thread, which the stage's own messages wait behind.
  std::multimap<std::uint64_t, transport::bulk_region> spare_;
  std::uint64_t persisted_ = 0;
  // Restarts from disk seen (WindowPersisted.restart): a pull begun before one is of a
  // timeline the job left.
  std::uint64_t timeline_ = 0;
};

// Pulls one slot for a replicator and hands it over, then stops (one per StoreSlot).
class slot_puller : public actors::actor {
 public:
  using interface = actors::interface<>;
  slot_puller(engine::bulk_io& io, transport::bulk_descriptor desc,
              std::shared_ptr<transport::bulk_region> holder, std::uint64_t chunk,
              actors::actor_ref replicator, replicator::key id, actors::actor_ref from,
              std::uint64_t timeline);

 protected:
  asio::awaitable<void> on_start() override;

 private:
  engine::bulk_io& io_;
  transport::bulk_descriptor desc_;
  std::shared_ptr<transport::bulk_region> holder_;
  std::uint64_t chunk_;
  actors::actor_ref replicator_;
  replicator::key id_;
  actors::actor_ref from_;
  std::uint64_t timeline_;
};

}  // namespace moevement::recovery
