@0xda4e8a1cc653318f;
# The protocol of policy moevement's actors (recovery/moevement_policy.hpp): a stage's
# checkpoint agent ships snapshot slots to replicators on other workers, and a replacement
# pulls slots from replicators and its neighbours' upstream logs from their agents. Every
# message is untrusted: sizes are checked against limits and against what the receiver
# expects, descriptors against the exporter's regions.

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("moevement::recovery::wire");

using Envelope = import "/transport/envelope.capnp";
using Bulk = import "/transport/bulk.capnp";

struct SlotKey {
  stage @0 :Int32;
  replica @1 :Int32;
  window @2 :UInt64;
  slot @3 :UInt32;
}
# Agent -> replicator: pull this slot and keep it; answer SlotStored to `from`. With `share`,
# a replicator on the agent's host maps the slot's memory instead (pulling only if that fails).
struct StoreSlot {
  key @0 :SlotKey;
  tensor @1 :Bulk.BulkDescriptor;
  from @2 :Envelope.ActorAddress;
  share @3 :Bulk.ShareHandle;
  # Failure injection (`--inject flip:...,target=slot`): once a pulled copy is stored, this bit
  # of it is flipped (a mapped copy is the owner's memory and is left alone). -1: none.
  flipBit @4 :Int64 = -1;
}
struct SlotStored {
  key @0 :SlotKey;
  ok @1 :Bool;
  error @2 :Text;
  mapped @3 :Bool;  # stored by mapping the offered memory (no copy)
}
# Agent -> replicator: several slots at once (small ones, one message per window: their
# messages, not their bytes, were their cost); each answered as a StoreSlot is, the answers
# given at once together in one SlotsStored.
struct StoreSlots {
  slots @0 :List(StoreSlot);
}
struct SlotsStored {
  answers @0 :List(SlotStored);
}
# Replacement -> replicator: where is this slot (found false: not here).
struct FetchSlot {
  key @0 :SlotKey;
}
struct SlotData {
  found @0 :Bool;
  tensor @1 :Bulk.BulkDescriptor;
  share @2 :Bulk.ShareHandle;  # set when the replicator holds it mapped: map it on its host
}
# Replacement -> a neighbour's agent: the boundary tensors it sent to `replica` of the
# failed stage in iterations [fromIteration, toIteration], every micro-batch, as one buffer
# in (iteration, micro-batch) order; each tensor exactly floatsEach floats.
struct FetchLog {
  fromIteration @0 :Int64;
  toIteration @1 :Int64;
  gradient @2 :Bool;      # false: activations sent downstream; true: gradients sent upstream
  replica @3 :UInt32;
  microBatches @4 :UInt32;
  floatsEach @5 :UInt64;
}
struct LogData {
  error @0 :Text;        # non-empty: not served (what is missing)
  tensor @1 :Bulk.BulkDescriptor;
  lease @2 :UInt64;      # ReleaseLog(lease) once pulled
}
struct ReleaseLog {
  lease @0 :UInt64;
}
# Replacement -> the agent of a surviving replica of its stage: its sparse schedule's state
# (stage_schedule::state), so that the recovery group keeps scheduling alike. has false: no
# schedule yet (W_sparse not chosen).
struct FetchSchedule {}
struct ScheduleSlot {
  active @0 :List(UInt32);
  frozen @1 :List(UInt32);
}
struct WindowCounts {
  window @0 :UInt64;
  counts @1 :List(Float64);
}
struct WindowSchedule {
  window @0 :UInt64;
  slots @1 :List(ScheduleSlot);
}
struct ScheduleState {
  has @0 :Bool;
  order @1 :List(UInt32);
  orderPopularity @2 :List(Float64);
  counts @3 :List(WindowCounts);
  schedules @4 :List(WindowSchedule);
  reorders @5 :UInt64;
  decayed @6 :List(Float64);       # time-decayed ordering: the moving average
  pending @7 :List(Float64);       # and the counts of pendingIteration not folded in yet
  pendingIteration @8 :Int64;
  pendingWindow @9 :UInt64;        # the window pendingIteration's counts go to
}

# Member of a recovery group replaying in parallel -> every other member's group exchange
# (recovery/group_replay.hpp): its replica's weight gradients after replaying `iteration`
# (every stage of the region, stage order), exported until the member has every peer's
# gradients of iteration + 1.
struct ReplayGradients {
  generation @0 :UInt64;
  iteration @1 :Int64;
  replica @2 :UInt32;
  tensor @3 :Bulk.BulkDescriptor;
}

# Member of a group replay under expert parallelism -> every other member's group exchange
# (recovery/group_replay.hpp): the expert router this member's replay computes its EP group's
# rows with, for the generation. Its EP group's members route their rows there.
struct ReplayExperts {
  generation @0 :UInt64;
  replica @1 :UInt32;
  router @2 :Envelope.ActorAddress;
}

# Member of a joint region replayed as a pipeline -> the group exchange of the member replaying
# the stage after it (an activation) or before it (a gradient), same replica
# (recovery/group_replay.hpp boundary_exchange): the tensor it sent at (iteration,
# microBatch), exported until that member pulled it. iteration 2^63 - 1: the member is done (a
# marker, never pulled).
struct ReplayBoundary {
  generation @0 :UInt64;
  iteration @1 :Int64;
  microBatch @2 :UInt32;
  gradient @3 :Bool;
  tensor @4 :Bulk.BulkDescriptor;
}
