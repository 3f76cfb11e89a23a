#include "sim/cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "base/require.hpp"

namespace moevement::sim {
namespace {

bool is_replicated(op_kind k) {
  return k != op_kind::expert;
}

// Forward + backward FLOPs per token of one layer's attention: projections (6 x params) plus the
// causal score and value products (forward 2 x seq x hidden, x3 with backward).
double attention_flops_per_token(const model_shape& m) {
  return 6.0 * attention_params(m) + 6.0 * m.seq_len * static_cast<double>(m.hidden);
}

// Routed-expert token shares, largest first: share_j = min(1, top_k x p_j), p ~ Zipf(s).
std::vector<double> expert_shares(const model_shape& m, double zipf) {
  std::vector<double> p(static_cast<std::size_t>(m.experts));
  for (int j = 0; j < m.experts; ++j)
    p[static_cast<std::size_t>(j)] = 1.0 / std::pow(j + 1.0, zipf);
  const double sum = std::accumulate(p.begin(), p.end(), 0.0);
  for (auto& x : p) x = std::min(1.0, m.top_k * x / sum);
  return p;
}

double ffn_flops_per_token(const model_shape& m, int layer) {
  if (!layer_is_moe(m, layer)) return 6.0 * dense_ffn_params(m);
  return 6.0 * m.hidden * static_cast<double>(m.experts) +
         6.0 * expert_params(m) * (m.top_k + m.shared_experts);
}

double embedding_flops_per_token(const model_shape& m) {
  return 6.0 * m.extra_params;
}
double head_flops_per_token(const model_shape& m) {
  return 6.0 * static_cast<double>(m.vocab) * m.hidden;
}

// Blocks are half-layers: block 2l is layer l's attention (with the embedding before layer 0),
// block 2l + 1 its FFN or MoE (with the head after the last layer). Splitting at half-layers
// lets deep pipelines have more stages than layers (Figure 11: 61 layers on 64 stages).
double block_cost(const model_shape& m, int b) {
  const int layer = b / 2;
  if (b % 2 == 0) return attention_flops_per_token(m) + (b == 0 ? embedding_flops_per_token(m) : 0);
  return ffn_flops_per_token(m, layer) + (layer == m.layers - 1 ? head_flops_per_token(m) : 0);
}

// Contiguous split of the blocks into `stages` non-empty groups minimizing the largest
// per-token cost. Returns the first block of each stage plus the block count at the end.
// Binary search on the cap, greedy fill per cap.
std::vector<int> partition_blocks(const model_shape& m, int stages) {
  const int blocks = 2 * m.layers;
  std::vector<double> cost(static_cast<std::size_t>(blocks));
  for (int b = 0; b < blocks; ++b) cost[static_cast<std::size_t>(b)] = block_cost(m, b);
  const auto greedy = [&](double cap) {
    std::vector<int> bounds{0};
    double acc = 0;
    for (int b = 0; b < blocks; ++b) {
      const double c = cost[static_cast<std::size_t>(b)];
      if (acc + c > cap && b > bounds.back()) {
        bounds.push_back(b);
        acc = 0;
      }
      acc += c;
    }
    return bounds;
  };
  double lo = *std::max_element(cost.begin(), cost.end());
  double hi = std::accumulate(cost.begin(), cost.end(), 0.0);
  for (int iter = 0; iter < 100; ++iter) {
    const double mid = 0.5 * (lo + hi);
    (static_cast<int>(greedy(mid).size()) <= stages ? hi : lo) = mid;
  }
  std::vector<int> bounds = greedy(hi);
  // Fewer groups than stages: split multi-block groups (never raises the largest cost).
  while (static_cast<int>(bounds.size()) < stages) {
    bounds.push_back(blocks);
    for (std::size_t g = bounds.size() - 1; g-- > 0;) {
      if (bounds[g + 1] - bounds[g] >= 2) {
        bounds.insert(bounds.begin() + static_cast<std::ptrdiff_t>(g) + 1, bounds[g + 1] - 1);
        break;
      }
    }
    bounds.pop_back();
  }
  bounds.push_back(blocks);
  return bounds;
}

double microbatch_compute_s(const stage_costs& s, const std::vector<double>& factor) {
  double replicated = 0;
  std::vector<double> per_rank(static_cast<std::size_t>(s.ep), 0.0);
  for (std::size_t i = 0; i < s.ops.size(); ++i) {
    const double f = s.ops[i].flops_per_token * s.tokens_per_microbatch * factor[i];
    if (s.ops[i].ep_rank < 0) {
      replicated += f;
    } else {
      per_rank[static_cast<std::size_t>(s.ops[i].ep_rank)] += f / s.expert_replication;
    }
  }
  const double worst_rank = *std::max_element(per_rank.begin(), per_rank.end());
  return (replicated / s.ep + worst_rank) / s.flops_per_s;
}

}  // namespace

double ring_allreduce_s(double bytes, int p, double bw, double alpha) {
  if (p <= 1 || bytes <= 0) return 0;
  // alpha(p) = 2 (p - 1) alpha; beta(p) = 2 (p - 1) / (p bw).
  return 2.0 * (p - 1) * alpha + 2.0 * (p - 1) / p * bytes / bw;
}

double all_to_all_s(double bytes_per_rank, int p, double bw, double alpha) {
  if (p <= 1 || bytes_per_rank <= 0) return 0;
  return (p - 1) * alpha + (p - 1.0) / p * bytes_per_rank / bw;
}

double snapshot_bandwidth_per_gpu(const cluster_spec& c, int replicas) {
  if (c.snapshot_bytes_per_s > 0) return c.snapshot_bytes_per_s;
  const double network =
      replicas > 0 ? c.inter_node_bytes_per_s / (c.gpus_per_node * static_cast<double>(replicas))
                   : c.host_device_bytes_per_s;
  return std::min(c.host_device_bytes_per_s, network);
}

iteration_costs estimate_iteration(const model_shape& m, const cluster_spec& c, const plan_spec& p,
                                   const model_constants& k, int snapshot_replicas) {
  require(m.layers > 0 && m.hidden > 0, "model: layers and hidden must be positive");
  require(p.pp >= 1 && p.dp >= 1 && p.ep >= 1, "plan: pp, dp and ep must be at least 1");
  require(p.pp <= 2 * m.layers, "plan.pp: " + std::to_string(p.pp) +
                                    " stages but the model has only " +
                                    std::to_string(2 * m.layers) + " half-layers");
  require(m.experts == 0 || m.experts % p.ep == 0 || p.ep % m.experts == 0,
          "plan.ep: " + std::to_string(p.ep) + " and the " + std::to_string(m.experts) +
              " experts per layer must divide one another");
  require(p.micro_batch >= 1 && p.global_batch % (p.micro_batch * p.dp) == 0,
          "plan.global_batch: " + std::to_string(p.global_batch) +
              " is not a multiple of plan.micro_batch x plan.dp");
  require(c.peak_flops > 0 && c.compute_efficiency > 0 && c.compute_efficiency <= 1,
          "cluster.compute_efficiency must be in (0, 1] and cluster.peak_tflops positive");
  require(c.gpus_per_node >= 1, "cluster.gpus_per_node must be at least 1");
  require(c.intra_node_bytes_per_s > 0 && c.inter_node_bytes_per_s > 0 &&
              c.host_device_bytes_per_s > 0 && c.hbm_bytes_per_s > 0 && c.storage_bytes_per_s > 0,
          "cluster: every bandwidth must be positive");

  iteration_costs out;
  out.microbatches = p.microbatches();
  const auto bounds = partition_blocks(m, p.pp);
  // With fewer experts than EP ranks each expert is replicated on ep / experts ranks.
  const int expert_replication = m.experts > 0 && p.ep > m.experts ? p.ep / m.experts : 1;
  const auto shares = expert_shares(m, k.expert_popularity_zipf);
  const double tokens_mb = static_cast<double>(p.micro_batch) * m.seq_len;
  const double inter_bw = c.inter_node_bytes_per_s_per_gpu();
  const bool ep_intra = p.ep <= c.gpus_per_node;
  const double a2a_bw = ep_intra ? c.intra_node_bytes_per_s : inter_bw;
  const double a2a_alpha = ep_intra ? c.alpha_intra_s : c.alpha_inter_s;
  const bool pipeline_intra = p.ep * p.pp <= c.gpus_per_node;
  const double p2p_bw = pipeline_intra ? c.intra_node_bytes_per_s : inter_bw;
  const double p2p_alpha = pipeline_intra ? c.alpha_intra_s : c.alpha_inter_s;
  const double snap_bw = snapshot_bandwidth_per_gpu(c, snapshot_replicas);

  double worst_mb = 0;
  for (int s = 0; s < p.pp; ++s) {
    stage_costs st;
    st.ep = p.ep;
    st.gpus = p.ep * p.dp;
    st.tokens_per_microbatch = tokens_mb;
    st.flops_per_s = c.peak_flops * c.compute_efficiency;
    st.expert_replication = expert_replication;
    const auto add = [&](op_kind kind, int layer, double params, double flops, double share,
                         int rank) {
      st.ops.push_back(stage_op{kind, layer, params, flops, share, rank});
    };
    if (s == 0)
      add(op_kind::embedding, -1, embedding_params(m), embedding_flops_per_token(m), 1, -1);
    for (int b = bounds[static_cast<std::size_t>(s)]; b < bounds[static_cast<std::size_t>(s) + 1];
         ++b) {
      const int l = b / 2;
      if (b % 2 == 0) {
        add(op_kind::attention, l, attention_params(m), attention_flops_per_token(m), 1, -1);
      } else if (layer_is_moe(m, l)) {
        const double gate = static_cast<double>(m.hidden) * m.experts;
        add(op_kind::gate, l, gate, 6.0 * gate, 1, -1);
        for (int e = 0; e < m.shared_experts; ++e) {
          add(op_kind::shared_expert, l, expert_params(m), 6.0 * expert_params(m), 1, -1);
        }
        for (int e = 0; e < m.experts; ++e) {
          const double share = shares[static_cast<std::size_t>(e)];
          add(op_kind::expert, l, expert_params(m), 6.0 * expert_params(m) * share, share,
              e % p.ep);
        }
      } else {
        add(op_kind::dense_ffn, l, dense_ffn_params(m), 6.0 * dense_ffn_params(m), 1, -1);
      }
    }
    if (s == p.pp - 1) add(op_kind::head, -1, head_params(m), head_flops_per_token(m), 1, -1);

    double replicated_params = 0, expert_params_total = 0;
    int moe_layers = 0;
    for (const auto& op : st.ops) {
      (is_replicated(op.kind) ? replicated_params : expert_params_total) += op.params;
      if (op.kind == op_kind::gate) ++moe_layers;
      st.snapshot.push_back(sparse_op{static_cast<std::uint64_t>(2 * op.params),
                                      static_cast<std::uint64_t>(4 * op.params),
                                      static_cast<std::uint64_t>(8 * op.params), op.token_share});
    }
    st.params = replicated_params + expert_params_total;

    st.compute_s = microbatch_compute_s(st, std::vector<double>(st.ops.size(), 1.0));
    // Four all-to-alls per MoE layer (dispatch and combine, forward and backward).
    const double a2a_bytes = tokens_mb / p.ep * m.top_k * m.hidden * 2.0;
    const double a2a = 4.0 * moe_layers * all_to_all_s(a2a_bytes, p.ep, a2a_bw, a2a_alpha);
    // Boundary p2p: activations downstream, gradients upstream, each GPU sends its shard.
    const int boundaries = (s > 0 ? 1 : 0) + (s < p.pp - 1 ? 1 : 0);
    const double p2p = boundaries * (p2p_alpha + tokens_mb * m.hidden * 2.0 / p.ep / p2p_bw);
    st.comm_s = a2a + p2p;
    st.microbatch_s = st.compute_s + st.comm_s;
    worst_mb = std::max(worst_mb, st.microbatch_s);

    // Gradient reduction: replicated parameters over EP x DP GPUs, each expert over its DP x
    // replication holders.
    const int ne_group = p.ep * p.dp;
    const bool ne_intra = ne_group <= c.gpus_per_node && p.dp == 1;
    const int ex_group = p.dp * expert_replication;
    const bool ex_intra =
        (p.dp == 1 && p.ep <= c.gpus_per_node) || (p.dp - 1) * p.pp * p.ep + 1 <= c.gpus_per_node;
    const double ne = ring_allreduce_s(replicated_params * k.grad_bytes_per_param, ne_group,
                                       ne_intra ? c.intra_node_bytes_per_s : inter_bw,
                                       ne_intra ? c.alpha_intra_s : c.alpha_inter_s);
    const double ex = ring_allreduce_s(
        expert_params_total / std::min(p.ep, std::max(1, m.experts)) * k.grad_bytes_per_param,
        ex_group, ex_intra ? c.intra_node_bytes_per_s : inter_bw,
        ex_intra ? c.alpha_intra_s : c.alpha_inter_s);
    st.sync_s = (ne + ex) * (1.0 - k.sync_overlap);
    st.params_per_gpu =
        replicated_params + expert_params_total / std::min(p.ep, std::max(1, m.experts));
    const double shard =
        p.zero1 ? replicated_params / ne_group + expert_params_total / st.gpus : st.params_per_gpu;
    st.update_s = shard * k.update_bytes_per_param / c.hbm_bytes_per_s;
    st.memory_per_gpu = st.params_per_gpu * 4.0 + shard * 12.0;
    st.snapshot_bytes_per_s = snap_bw * st.gpus;
    out.total_params += st.params;
    out.stages.push_back(std::move(st));
  }
  out.pipeline_s = (out.microbatches + p.pp - 1) * worst_mb;
  for (const auto& st : out.stages) {
    out.sync_s = std::max(out.sync_s, st.sync_s);
    out.update_s = std::max(out.update_s, st.update_s);
  }
  out.iteration_s = out.pipeline_s + out.sync_s + out.update_s;
  return out;
}

double local_replay_iteration_s(const stage_costs& stage, const std::vector<bool>& active,
                                int microbatches, const model_constants& k) {
  require(active.size() == stage.ops.size(), "replay: one active flag per operator");
  std::vector<double> factor(stage.ops.size());
  double active_params = 0;
  for (std::size_t i = 0; i < stage.ops.size(); ++i) {
    factor[i] = active[i] ? 1.0 : k.frozen_compute_fraction;
    if (active[i]) active_params += stage.ops[i].params;
  }
  const double fraction = stage.params > 0 ? active_params / stage.params : 1.0;
  return microbatches * (microbatch_compute_s(stage, factor) + stage.comm_s) +
         fraction * (stage.sync_s + stage.update_s);
}

}  // namespace moevement::sim
