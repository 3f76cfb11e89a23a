// Analytical iteration-time model (paper appendix C): per-stage compute and communication,
// 1F1B pipeline time (M + S - 1) x max stage time, plus gradient synchronization and the
// optimizer update. Collectives cost alpha(p) + beta(p) x m. Every constant has its one default
// here; docs/simulator.md says where each comes from.
#pragma once

#include <string>
#include <vector>

#include "sim/paper_models.hpp"
#include "sim/sparse_schedule.hpp"

namespace moevement::sim {

struct cluster_spec {
  std::string gpu = "a100-80gb";
  double peak_flops = 312e12;       // dense FP16/BF16 tensor-core peak per GPU
  double compute_efficiency = 0.5;  // sustained fraction of peak in training GEMMs
  double gpu_memory_bytes = 80e9;
  double hbm_bytes_per_s = 2.0e12;  // A100 80 GB: 2.0 TB/s
  int gpus_per_node = 8;
  double intra_node_bytes_per_s = 300e9;  // NVLink 600 GB/s bidirectional, per GPU per direction
  double inter_node_bytes_per_s = 10e9;   // per node: 80 Gbps (paper 5.1)
  double host_device_bytes_per_s = 12e9;  // effective pinned GPU->CPU copy per GPU (PCIe 4 x16)
  double storage_bytes_per_s = 5e9;       // aggregate to durable storage: 40 Gbps (paper 5.1)
  double alpha_intra_s = 10e-6;           // per ring step inside a node
  double alpha_inter_s = 30e-6;           // per ring step across nodes
  // Measured or calibrated snapshot bandwidth per GPU (to host memory and r peers); 0: derive
  // it from host_device and inter_node bandwidths (snapshot_bandwidth_per_gpu).
  double snapshot_bytes_per_s = 0;
  // A node's inter-node bandwidth shared by its GPUs.
  double inter_node_bytes_per_s_per_gpu() const { return inter_node_bytes_per_s / gpus_per_node; }
};

struct plan_spec {
  int pp = 1;
  int dp = 1;
  int ep = 1;
  int global_batch = 512;  // sequences per iteration
  int micro_batch = 32;    // sequences per micro-batch, shared by the EP ranks of a stage
  bool zero1 = true;       // optimizer state sharded over the replicas of each parameter
  int microbatches() const { return global_batch / (micro_batch * dp); }
  int gpus() const { return pp * dp * ep; }
};

// Fixed modelling constants that are not properties of a cluster or plan.
struct model_constants {
  double expert_popularity_zipf = 0.0;  // routed-expert token share ~ 1/(rank+1)^s; 0: uniform
  double frozen_compute_fraction = 2.0 / 3.0;  // forward + input gradient of fwd+in+weight grads
  double update_bytes_per_param = 32;  // optimizer step HBM traffic (read/write master, m, v,
                                       // grad; write compute weights)
  double sync_overlap = 0.0;           // fraction of gradient sync hidden behind backward
  double grad_bytes_per_param = 2;     // gradients are reduced in FP16/BF16
};

enum class op_kind { embedding, attention, dense_ffn, gate, expert, shared_expert, head };

struct stage_op {
  op_kind kind;
  int layer = -1;  // -1 for embedding/head
  double params = 0;
  double flops_per_token = 0;  // forward + backward, averaged over tokens (experts by share)
  double token_share = 1;      // fraction of the stage's tokens it sees
  int ep_rank = -1;            // expert placement inside the EP group (-1: replicated)
};

struct stage_costs {
  std::vector<stage_op> ops;        // in model order
  std::vector<sparse_op> snapshot;  // same order: sizes for Algorithm 1, popularity
  double params = 0;
  double microbatch_s = 0;          // forward + backward of one micro-batch, all active
  double compute_s = 0;             // of which compute
  double comm_s = 0;                // of which all-to-all and stage-boundary p2p
  double sync_s = 0;                // gradient reduction across replicas
  double update_s = 0;              // optimizer step
  double snapshot_bytes_per_s = 0;  // aggregate snapshot bandwidth of the stage's GPUs
  double params_per_gpu = 0;
  double memory_per_gpu = 0;  // bytes of weights, grads, optimizer shard (no activations)
  int gpus = 0;               // GPUs holding this stage (EP x DP)
  int ep = 1;
  int expert_replication = 1;  // EP ranks holding each expert (ep / experts when ep > experts)
  double tokens_per_microbatch = 0;
  double flops_per_s = 0;  // sustained per GPU
};

struct iteration_costs {
  std::vector<stage_costs> stages;
  int microbatches = 0;
  double pipeline_s = 0;  // (M + S - 1) x max microbatch_s
  double sync_s = 0;
  double update_s = 0;
  double iteration_s = 0;
  double total_params = 0;
  double dispatch_s = 0;  // wall time between iterations outside them (measured only; profile)
};

// alpha(p) + beta(p) x m for ring collectives over p ranks with per-rank bandwidth `bw`.
double ring_allreduce_s(double bytes, int p, double bw, double alpha);
double all_to_all_s(double bytes_per_rank, int p, double bw, double alpha);

// Per-GPU bandwidth at which a stage can snapshot to host memory and replicate to `replicas`
// peers, sustained every iteration: min(host-device, node network / (GPUs per node x r)).
double snapshot_bandwidth_per_gpu(const cluster_spec& c, int replicas);

// Throws std::invalid_argument naming the offending setting when the plan cannot run the model
// on the cluster (degrees that do not divide, more stages than layers, ...).
iteration_costs estimate_iteration(const model_shape& m, const cluster_spec& c, const plan_spec& p,
                                   const model_constants& k, int snapshot_replicas);

// Time for the GPUs of `stage` to replay one iteration locally (no pipeline bubbles: M x the
// micro-batch time) when the operators flagged in `active` (by index into stage.ops) run
// forward, input and weight gradients and the update, and the rest only forward and input
// gradients. Sync and update are counted for active operators only.
double local_replay_iteration_s(const stage_costs& stage, const std::vector<bool>& active,
                                int microbatches, const model_constants& k);

}  // namespace moevement::sim
