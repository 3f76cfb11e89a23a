// The CUDA backend: the kernels of cpu/kernels.hpp on device memory, with the same shapes and
// conventions (input gradients written, weight gradients accumulated, skipped when null).
// Determinism: one stream per context; GEMMs through cuBLASLt with FP32 pedantic compute (no
// TF32), a fixed workspace on that stream and the algorithm pinned per shape; our kernels never
// use float atomics: each output element is written by one thread (or one warp, folding its
// lanes in element order), which reduces in a fixed order, mostly the CPU's. Bitwise the CPU's:
// GELU (the same polynomial exp), the embedding, the norm weight gradients, the MoE
// permutation, AdamW, the compute-weight rounding and sum_squares; the rest match the CPU to
// rounding and themselves bitwise run to run.
// Built when CUDA is found; without it every entry point throws (kernels_stub.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "models/cpu/kernels.hpp"
#include "models/tensor.hpp"

namespace moevement::models::cuda {

// A stream, a cuBLASLt handle, its fixed workspace and the pinned GEMM algorithms, on one
// device (an index among the visible ones). Throws without a GPU, or for an index past them.
class context {
 public:
  explicit context(int device = 0);
  ~context();
  context(const context&) = delete;
  context& operator=(const context&) = delete;
  void synchronize();
  int device() const;
  // The CUDA stream (a cudaStream_t) the context's work is queued on, for a library that
  // queues its own work after it (NCCL's collectives).
  void* stream();
  struct impl;
  // Makes the context's device the calling thread's current one (CUDA's current device is per
  // thread, and a stage may be built on one thread and run on another), then its state.
  impl& get();

 private:
  std::unique_ptr<impl> impl_;
};

// Owned device array of T (float, std::int32_t or double).
template <class T>
class device_array {
 public:
  device_array(context& ctx, std::size_t n);
  ~device_array();
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return n_; }
  void upload(const std::vector<T>& host);  // host.size() == size()
  std::vector<T> download() const;          // synchronises the context's stream

 private:
  context& ctx_;
  T* data_ = nullptr;
  std::size_t n_ = 0;
};

using float_buffer = std::unique_ptr<device_array<float>>;
inline float_buffer make_float_buffer(context& ctx, std::size_t n) {
  return std::make_unique<device_array<float>>(ctx, n);
}

void matmul_forward(context& ctx, float* out, const float* x, const float* w, int n, int in,
                    int out_dim);
void matmul_backward(context& ctx, float* dx, float* dw, const float* dout, const float* x,
                     const float* w, int n, int in, int out_dim);
void embedding_forward(context& ctx, float* out, const std::int32_t* tokens, const float* wte,
                       const float* wpe, int b, int t, int c);
// v: rows of wte (dwte [V,C])
void embedding_backward(context& ctx, float* dwte, float* dwpe, const float* dout,
                        const std::int32_t* tokens, int b, int t, int c, int v);
void rmsnorm_forward(context& ctx, float* out, float* rstd, const float* x, const float* w, int n,
                     int c);
void rmsnorm_backward(context& ctx, float* dx, float* dw, const float* dout, const float* x,
                      const float* w, const float* rstd, int n, int c);
// att [B,NH,T,T]; scratch for backward [B,NH,T,T]
void attention_forward(context& ctx, float* y, float* att, const float* qkv, int b, int t, int c,
                       int nh);
void attention_backward(context& ctx, float* dqkv, float* scratch, const float* dy,
                        const float* att, const float* qkv, int b, int t, int c, int nh);
void gelu_forward(context& ctx, float* out, const float* x, int n);
void gelu_backward(context& ctx, float* dx, const float* dout, const float* x, int n);
void softmax_xent_forward(context& ctx, float* losses, float* probs, const float* logits,
                          const std::int32_t* targets, int n, int v);
void softmax_xent_backward(context& ctx, float* dlogits, const float* probs,
                           const std::int32_t* targets, float dloss, int n, int v);

// MoE routing: the gate's logits come back to the host, cpu::gate_forward (softmax, top-k,
// stable counting sort, capacity) plans the permutation, and its arrays go to the device.
// The permutation is tiny next to the expert GEMMs, and one planner means one set of bits.
struct device_routing {
  cpu::routing host;  // the plan (probs, expert, weight, row, offsets, token, routed, aux)
  std::unique_ptr<device_array<float>> probs, weight;         // [N,E], [N,K]
  std::unique_ptr<device_array<std::int32_t>> expert, row;    // [N,K], [N,K]
  std::unique_ptr<device_array<std::int32_t>> token, routed;  // [rows], [E]
};
void gate_forward(context& ctx, device_routing& r, const float* logits, int n, int e, int k,
                  double capacity_factor);
void gate_backward(context& ctx, float* dlogits, const device_routing& r, const float* dweight,
                   float daux);
void moe_gather(context& ctx, float* xs, const float* x, const device_routing& r, int c);
void moe_combine_forward(context& ctx, float* out, const float* ye, const device_routing& r, int c);
void moe_combine_backward(context& ctx, float* dye, float* dweight, const float* dout,
                          const float* ye, const device_routing& r, int c);
void moe_scatter_add(context& ctx, float* dx, const float* dxs, const device_routing& r, int c);

// Plain memory on the context's stream. copy_to_host synchronises; the others are queued.
// copy_to_device from pageable host memory returns once the driver has staged the bytes, so the
// source may be reused at once; from pinned memory it would have to outlive the copy.
void copy_to_device(context& ctx, void* dst, const void* src, std::size_t bytes);
void copy_to_host(context& ctx, void* dst, const void* src, std::size_t bytes);
void copy_on_device(context& ctx, void* dst, const void* src, std::size_t bytes);
void fill_zero(context& ctx, void* dst, std::size_t bytes);
// out = a + b elementwise (out may be a or b).
void add(context& ctx, float* out, const float* a, const float* b, long n);
// weights[i] = the exact fp32 value of master[i] rounded to `compute` (nearest even): bitwise
// what operator_state::refresh_compute derives on the CPU, special values included.
void round_to_compute(context& ctx, float* weights, const float* master, long n, dtype compute);
// One AdamW step over n elements with operator_state::adamw_step's exact sequence of IEEE
// operations (no FMA, correctly rounded sqrt and division): the same bits as the CPU for the
// same gradient. bc1, bc2: the bias corrections, computed once per operator on the host.
struct adamw_scalars {
  float lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_mul;
};
void adamw_step(context& ctx, float* w, float* m, float* v, const float* grad, long n,
                const adamw_scalars& s);
// out[i] = sum of grads[i][j]^2 in fp64 over j < sizes[i], for every i in one launch, in
// operator_state::grad_sq_sum's order (8 partial sums, element j into partial j % 8, the
// partials added in order, then the tail): bitwise the CPU's value. out: device, [count].
void sum_squares(context& ctx, double* out, std::span<const float* const> grads,
                 std::span<const long> sizes);
// A second stream on the context's device, for copies to the host that overlap the compute
// stream's kernels (a snapshot taken while the next iteration runs).
// - mark(): records where the compute stream is now (call it on the thread that queues the
//   compute, after the work the copies must follow).
// - Every later copy waits for that mark on the device, not on the host.
// - synchronize(): the host waits for the copies queued so far.
// Copies into page-locked host memory (pin_host_memory, alloc_pinned) are DMA transfers;
// into pageable memory they still work, through the driver's staging buffers, more slowly.
// Largest single transfer a copy_stream queues (a slot's tensors go in pieces of this size).
inline constexpr std::size_t copy_piece_bytes = 4u << 20;
class copy_stream {
 public:
  explicit copy_stream(context& ctx);
  ~copy_stream();
  copy_stream(const copy_stream&) = delete;
  copy_stream& operator=(const copy_stream&) = delete;
  void mark();
  void copy_to_host(void* dst, const void* src, std::size_t bytes);
  // dst[i] = master[i] in `compute`'s storage format (operator_state::compute_bytes: f32
  // copied, f16 and bf16 rounded to nearest even, 2 bytes each): what refresh_compute stores
  // on the CPU, for a snapshot slot's compute-only entries. dst: device memory of
  // n * dtype_size bytes. Queued on this stream, after the mark.
  void compute_bytes(void* dst, const float* master, long n, dtype compute);
  void synchronize();
  struct impl;

 private:
  context& ctx_;
  std::unique_ptr<impl> impl_;
};
// Page-locks `bytes` (page-aligned host memory: an mmap'd region) for DMA; unlocked when the
// returned handle is released. Throws when the driver refuses.
std::shared_ptr<void> pin_host_memory(context& ctx, std::span<std::byte> bytes);
// Page-locked host memory of n bytes, freed with the last owner.
std::shared_ptr<std::byte[]> alloc_pinned(context& ctx, std::size_t n);

// Row-major C [M,N] = A [M,K] B [K,N] as the kernels call cuBLASLt, for benchmarks that time
// cuBLAS on the model's shapes (ta, tb: A or B stored transposed; beta 1 accumulates).
// batch > 1: `batch` such products, the i-th at a + i*stride_a, b + i*stride_b, c + i*stride_c.
void sgemm(context& ctx, bool ta, bool tb, int m, int n, int k, const float* a, int lda,
           const float* b, int ldb, float beta, float* c, int ldc, long stride_a = 0,
           long stride_b = 0, long stride_c = 0, int batch = 1);

}  // namespace moevement::models::cuda
