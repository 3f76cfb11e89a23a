// Naive fp64 references for every kernel of kernels.hpp, written independently of it (plain
// loops, no BLIS, no shared helpers) so that tests can check the fast kernels against them and
// check these against finite differences. Same shapes and conventions as kernels.hpp, except
// that weight gradients are written (=), not accumulated. Only tests use them.
#pragma once

#include <cstdint>
#include <vector>

namespace moevement::models::cpu::ref {

using vec = std::vector<double>;

vec matmul(const vec& x, const vec& w, int n, int in, int out);
void matmul_backward(vec& dx, vec& dw, const vec& dout, const vec& x, const vec& w, int n, int in,
                     int out);

vec embedding(const std::vector<std::int32_t>& tokens, const vec& wte, const vec& wpe, int b, int t,
              int c);
void embedding_backward(vec& dwte, vec& dwpe, const vec& dout,
                        const std::vector<std::int32_t>& tokens, int b, int t, int c, int v,
                        int max_t);

vec rmsnorm(const vec& x, const vec& w, int n, int c);
void rmsnorm_backward(vec& dx, vec& dw, const vec& dout, const vec& x, const vec& w, int n, int c);

vec attention(const vec& qkv, int b, int t, int c, int nh);
vec attention_backward(const vec& dy, const vec& qkv, int b, int t, int c, int nh);

vec gelu(const vec& x);
vec gelu_backward(const vec& dout, const vec& x);

// losses[n] = -log softmax(logits[n])[targets[n]]
vec softmax_xent(const vec& logits, const std::vector<std::int32_t>& targets, int n, int v);
vec softmax_xent_backward(const vec& logits, const std::vector<std::int32_t>& targets, double dloss,
                          int n, int v);

// A whole MoE block on normalized input x [N,C]: gate wg [C,E]; expert j has w1[j] [C,F] and
// w2[j] [F,C] with GELU between; top-k without renormalization; optional capacity (dropping
// the later (token, slot) assignments of an expert); out [N,C] and the Switch aux loss.
struct moe_weights {
  vec wg;
  std::vector<vec> w1, w2;
};
struct moe_result {
  vec out;
  double aux = 0.0;
};
moe_result moe(const vec& x, const moe_weights& w, int n, int c, int e, int k, int f,
               double capacity_factor);
// Gradients for dout [N,C] and aux-loss gradient daux (routing decisions held fixed).
struct moe_grads {
  vec dx;
  moe_weights dw;
};
moe_grads moe_backward(const vec& dout, double daux, const vec& x, const moe_weights& w, int n,
                       int c, int e, int k, int f, double capacity_factor);

}  // namespace moevement::models::cpu::ref
