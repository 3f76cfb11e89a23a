// Silent-corruption checks on the head (docs/recovery.md "Silent data corruption"): every
// replica of a stage holds the same bits after every step, so the per-operator digests they
// report after a step (Stepped.digests) must be equal. compare_replicas finds the operators
// where they are not and, where a strict majority of the copies agrees, names the replicas
// that differ from it. A pure function of the reports, tested on its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace moevement::engine {

// What one stage replica reported after a step.
struct replica_report {
  std::vector<std::uint64_t> digests;  // per operator, in the replica's order (empty: none)
  std::vector<bool> experts;           // ep > 1: which of them are experts (else empty)
};

// Copies of one operator that do not agree.
struct divergence {
  int stage = 0;
  std::size_t op = 0;  // its index in the operator lists of replicas[...]
  bool expert = false;
  std::vector<int> replicas;  // the replicas holding a copy, ascending
  std::vector<int> bad;       // those outside a strict majority (empty: no majority)
};

// reports[d * pp + s]. Non-experts are compared over every replica that reported; under ep > 1
// an expert only over the replicas holding the same shard (replica % ep alike), whose lists
// have the same layout. A replica whose report is empty, or whose list does not fit the
// others' (another length), is left out. Ordered by stage, then operator.
std::vector<divergence> compare_replicas(int pp, int dp, int ep,
                                         std::span<const replica_report> reports);

// The replicas to replace, as (stage, replica) pairs ascending: every divergence's bad ones.
// Empty when a divergence has no majority (two copies, or a tie): those need a judge.
std::vector<std::pair<int, int>> bad_replicas(std::span<const divergence> found);

// One line for the operator, e.g. "stage 1 operator 3 (layer2.attn): copies on replicas 0, 1,
// 2; replica 2 differs from the majority". names: the operator names of replica
// d.replicas.front()'s list (may be empty).
std::string describe(const divergence& d, std::span<const std::string> names);

}  // namespace moevement::engine
