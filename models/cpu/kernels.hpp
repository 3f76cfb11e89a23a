// CPU training kernels, forward and backward, in fp32 with a fixed summation order.
// llm.c style: raw pointers, shapes in comments. N = B*T tokens, C channels, V vocabulary,
// NH heads of hs = C/NH, E experts, K slots per token, F expert hidden size.
// Conventions: input gradients (dx...) are written (=); weight gradients are accumulated (+=)
// and skipped when the pointer is null (frozen operators compute no weight gradient).
// GEMMs go through gemm.hpp (BLIS); everything else is single-threaded loops, so the bits
// depend on nothing but the inputs. The fp64 references beside these are in reference.hpp.
#pragma once

#include <cstdint>
#include <vector>

namespace moevement::models::cpu {

// out[n,:] = x[n,:] @ w   x [N,IN], w [IN,OUT] (row-major), out [N,OUT]
void matmul_forward(float* out, const float* x, const float* w, int n, int in, int out_dim);
// dx = dout @ w^T (written, if dx); dw += x^T @ dout (if dw)
void matmul_backward(float* dx, float* dw, const float* dout, const float* x, const float* w, int n,
                     int in, int out_dim);

// out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]   tokens [B,T], wte [V,C], wpe [maxT,C]
void embedding_forward(float* out, const std::int32_t* tokens, const float* wte, const float* wpe,
                       int b, int t, int c);
// dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[t,:] += dout[b,t,:], in (b, t) order.
void embedding_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* tokens,
                        int b, int t, int c);

constexpr float rmsnorm_eps = 1e-5f;
// out = x * rstd * w, rstd[n] = 1/sqrt(mean(x[n,:]^2) + eps)   x [N,C], w [C], rstd [N]
void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int n, int c);
void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                      const float* rstd, int n, int c);

// Causal self-attention core. qkv [B,T,3C] (q | k | v, head h in columns h*hs..), y [B,T,C],
// att [B,NH,T,T] (softmax probabilities, zero above the diagonal; kept for backward).
void attention_forward(float* y, float* att, const float* qkv, int b, int t, int c, int nh);
// dqkv written [B,T,3C]; scratch [T,T].
void attention_backward(float* dqkv, float* scratch, const float* dy, const float* att,
                        const float* qkv, int b, int t, int c, int nh);

// tanh-approximated GELU, elementwise over n values.
void gelu_forward(float* out, const float* x, int n);
void gelu_backward(float* dx, const float* dout, const float* x, int n);

// probs [N,V] = softmax(logits); losses[n] = -log probs[n, targets[n]].
void softmax_xent_forward(float* losses, float* probs, const float* logits,
                          const std::int32_t* targets, int n, int v);
// dlogits = (probs - onehot(targets)) * dloss   (dloss: gradient of the loss per token)
void softmax_xent_backward(float* dlogits, const float* probs, const std::int32_t* targets,
                           float dloss, int n, int v);

// Routing of N tokens to E experts, K slots each. Assignments (n, k) are permuted by a stable
// counting sort on the expert id: the rows of expert e are offsets[e]..offsets[e+1], in
// (token, slot) order. With a capacity, the assignments of an expert past it are dropped.
struct routing {
  int n = 0, e = 0, k = 0;
  std::vector<float> probs;           // [N,E] softmax of the gate logits
  std::vector<std::int32_t> expert;   // [N,K] chosen experts, slot 0 the most probable
  std::vector<float> weight;          // [N,K] probs[n, expert[n,k]] (the combine weight)
  std::vector<std::int32_t> row;      // [N,K] row in the permuted order, -1 when dropped
  std::vector<std::int32_t> offsets;  // [E+1] kept rows of each expert
  std::vector<std::int32_t> token;    // [rows] token of each permuted row
  std::vector<std::int32_t> routed;   // [E] assignments before any capacity drop
  float aux_loss = 0.0f;              // E * sum_e f_e * P_e (Switch load-balancing loss)
  int rows() const { return offsets.empty() ? 0 : offsets.back(); }
};

// capacity_factor 0: dropless. Otherwise capacity = ceil(cf * N * K / E) rows per expert.
// Top-k ties go to the lower expert index.
void gate_forward(routing& r, const float* logits, int n, int e, int k, double capacity_factor);
// dlogits [N,E] written from dweight [N,K] (gradient of the combine weights) and the auxiliary
// loss gradient daux (aux_coef * loss scale / micro-batches); f_e is treated as a constant.
void gate_backward(float* dlogits, const routing& r, const float* dweight, float daux);

// xs[row,:] = x[token[row],:]   x [N,C], xs [rows,C]
void moe_gather(float* xs, const float* x, const routing& r, int c);
// out[n,:] = sum over kept slots k, in slot order, of weight[n,k] * ye[row[n,k],:]
void moe_combine_forward(float* out, const float* ye, const routing& r, int c);
// dye[row,:] = weight * dout[n,:]; dweight[n,k] = dot(dout[n,:], ye[row,:]) (0 if dropped)
void moe_combine_backward(float* dye, float* dweight, const float* dout, const float* ye,
                          const routing& r, int c);
// dx[n,:] += dxs[row[n,k],:] over kept slots in slot order   dxs [rows,C], dx [N,C]
void moe_scatter_add(float* dx, const float* dxs, const routing& r, int c);

}  // namespace moevement::models::cpu
