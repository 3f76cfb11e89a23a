// CUDA kernels; see kernels.hpp for the determinism rules. Where the CPU loops sequentially
// over a row, a warp folds the row in the CPU's element order; where it loops over rows, one
// thread per column adds them in row order. Slower than tree reductions, but every reduction
// has one fixed order (the CPU's, mostly) and there is no atomic anywhere.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "models/cuda/check.hpp"
#include "models/cuda/device.hpp"
#include "models/cuda/kernels.hpp"

namespace moevement::models::cuda {
namespace {

constexpr std::size_t workspace_bytes = 32u << 20;  // fixed cuBLAS workspace per context
constexpr int block = 256;
int blocks(long n) {
  return int((n + block - 1) / block);
}

}  // namespace

// One GEMM shape as cuBLASLt sees it, with the alignment of its pointers (which algorithms
// can run depends on it): the key of the algorithm pinned for it.
using gemm_key = std::array<long, 16>;

// The descriptors and the algorithm chosen for one gemm_key, once, then reused for every
// call: the same algorithm, so the same order of sums, however often and wherever it runs.
struct gemm_plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t x = nullptr, y = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  gemm_plan() = default;
  gemm_plan(const gemm_plan&) = delete;
  gemm_plan& operator=(const gemm_plan&) = delete;
  ~gemm_plan() {
    if (x != nullptr) cublasLtMatrixLayoutDestroy(x);
    if (y != nullptr) cublasLtMatrixLayoutDestroy(y);
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

struct context::impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  std::map<gemm_key, std::unique_ptr<gemm_plan>> plans;
};

context::context(int device) : impl_(std::make_unique<impl>()) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    throw std::runtime_error("no CUDA device visible");
  }
  if (device < 0 || device >= n) {
    throw std::invalid_argument("CUDA device " + std::to_string(device) + " asked for, " +
                                std::to_string(n) + " visible");
  }
  impl_->device = device;
  check(cudaSetDevice(device), "cudaSetDevice");
  check(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaMalloc(&impl_->workspace, workspace_bytes), "cudaMalloc(workspace)");
  if (const std::string why = open_cublaslt(); !why.empty()) {  // opened on first use
    throw std::runtime_error("cuBLASLt cannot be opened: " + why +
                             " (the CUDA toolkit's libcublasLt must be on the library path)");
  }
  check(cublasLtCreate(&impl_->lt), "cublasLtCreate");
}

context::~context() {
  (void)cudaSetDevice(impl_->device);
  impl_->plans.clear();
  if (impl_->lt != nullptr) cublasLtDestroy(impl_->lt);
  if (impl_->workspace != nullptr) cudaFree(impl_->workspace);
  if (impl_->stream != nullptr) cudaStreamDestroy(impl_->stream);
}

void context::synchronize() {
  check(cudaStreamSynchronize(get().stream), "cudaStreamSynchronize");
}

int context::device() const {
  return impl_->device;
}

void* context::stream() {
  return get().stream;
}

context::impl& context::get() {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != impl_->device) {
    check(cudaSetDevice(impl_->device), "cudaSetDevice");
  }
  return *impl_;
}

template <class T>
device_array<T>::device_array(context& ctx, std::size_t n) : ctx_(ctx), n_(n) {
  ctx.get();  // allocate on the context's device
  check(cudaMalloc(&data_, n * sizeof(T) + 1), "cudaMalloc");
}
template <class T>
device_array<T>::~device_array() {
  cudaFree(data_);  // unified addressing: freed on the device that holds it
}
template <class T>
void device_array<T>::upload(const std::vector<T>& host) {
  if (host.size() != n_) throw std::invalid_argument("device_array::upload: size mismatch");
  check(cudaMemcpyAsync(data_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice,
                        ctx_.get().stream),
        "cudaMemcpyAsync");
  ctx_.synchronize();
}
template <class T>
std::vector<T> device_array<T>::download() const {
  std::vector<T> out(n_);
  check(
      cudaMemcpyAsync(out.data(), data_, n_ * sizeof(T), cudaMemcpyDeviceToHost, ctx_.get().stream),
      "cudaMemcpyAsync");
  ctx_.synchronize();
  return out;
}
template class device_array<float>;
template class device_array<std::int32_t>;
template class device_array<double>;

namespace {

long alignment(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  return a == 0 ? 256 : long(std::min<std::uintptr_t>(a & (~a + 1), 256));
}

template <class T>
void set(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t what, T v) {
  check(cublasLtMatrixLayoutSetAttribute(l, what, &v, sizeof(v)),
        "cublasLtMatrixLayoutSetAttribute");
}

// Row-major C[m,n] = alpha op(A) op(B) + beta C as column-major C^T = op(B)^T op(A)^T, through
// cuBLASLt: FP32 with pedantic compute (no TF32, no reduced precision), the context's fixed
// workspace and stream, and the algorithm pinned per shape and alignment (gemm_plan).
void gemm(context& ctx, bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
          long stride_a, const float* b, int ldb, long stride_b, float beta, float* c, int ldc,
          long stride_c, int batch) {
  auto& s = ctx.get();
  const gemm_key key{
      ta,           tb,          m,        n,        k,     lda,          ldb,
      ldc,          stride_a,    stride_b, stride_c, batch, beta == 0.0f, alignment(a),
      alignment(b), alignment(c)};
  auto& slot = s.plans[key];
  if (!slot) {
    auto p = std::make_unique<gemm_plan>();
    check(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F_PEDANTIC, CUDA_R_32F),
          "cublasLtMatmulDescCreate");
    // column-major: x = B (n x k, or k x n transposed), y = A, c = C (n x m)
    const cublasOperation_t opx = tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                            opy = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opx, sizeof(opx)),
          "cublasLtMatmulDescSetAttribute");
    check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opy, sizeof(opy)),
          "cublasLtMatmulDescSetAttribute");
    check(cublasLtMatrixLayoutCreate(&p->x, CUDA_R_32F, tb ? k : n, tb ? n : k, ldb),
          "cublasLtMatrixLayoutCreate");
    check(cublasLtMatrixLayoutCreate(&p->y, CUDA_R_32F, ta ? m : k, ta ? k : m, lda),
          "cublasLtMatrixLayoutCreate");
    check(cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32F, n, m, ldc), "cublasLtMatrixLayoutCreate");
    if (batch > 1) {
      for (auto [l, stride] : {std::pair{p->x, stride_b}, {p->y, stride_a}, {p->c, stride_c}}) {
        set(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, std::int32_t(batch));
        set(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, std::int64_t(stride));
      }
    }
    cublasLtMatmulPreference_t pref = nullptr;
    check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    const std::unique_ptr<cublasLtMatmulPreferenceOpaque_t,
                          cublasStatus_t (*)(cublasLtMatmulPreference_t)>
        pref_owner(pref, cublasLtMatmulPreferenceDestroy);
    const std::uint64_t ws = workspace_bytes;
    auto prefer = [pref](cublasLtMatmulPreferenceAttributes_t what, const auto& v) {
      check(cublasLtMatmulPreferenceSetAttribute(pref, what, &v, sizeof(v)),
            "cublasLtMatmulPreferenceSetAttribute");
    };
    prefer(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws);
    // x is b, y is a; C and D are c
    const std::uint32_t ax = std::uint32_t(alignment(b)), ay = std::uint32_t(alignment(a)),
                        ac = std::uint32_t(alignment(c));
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, ax);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ay);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ac);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ac);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(s.lt, p->desc, p->x, p->y, p->c, p->c,
                                                             pref, 1, &result, &found);
    check(st, "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0) {
      throw std::runtime_error("cuBLASLt has no FP32 algorithm for a GEMM of " + std::to_string(m) +
                               "x" + std::to_string(n) + "x" + std::to_string(k));
    }
    p->algo = result.algo;
    slot = std::move(p);
  }
  const gemm_plan& p = *slot;
  check(cublasLtMatmul(s.lt, p.desc, &alpha, b, p.x, a, p.y, &beta, c, p.c, c, p.c, &p.algo,
                       s.workspace, workspace_bytes, s.stream),
        "cublasLtMatmul");
}

__global__ void embedding_forward_k(float* out, const std::int32_t* tok, const float* wte,
                                    const float* wpe, int b, int t, int c) {
  const long i = blockIdx.x * long(blockDim.x) + threadIdx.x;
  if (i >= long(b) * t * c) return;
  const long row = i / c;
  const int x = int(i % c), pos = int(row % t);
  out[i] = wte[long(tok[row]) * c + x] + wpe[long(pos) * c + x];
}

// dwte: thread per channel, tokens in (b, t) order, as the CPU does; no two threads share an
// element, so no atomics.
__global__ void embedding_backward_wte_k(float* dwte, const float* __restrict__ dout,
                                         const std::int32_t* __restrict__ tok, int n, int v,
                                         int c) {
  const long i = blockIdx.x * long(blockDim.x) + threadIdx.x;
  if (i >= long(v) * c) return;
  const int row = int(i / c), x = int(i % c);
  float acc = dwte[i];
  for (int r = 0; r < n; ++r) {
    if (tok[r] == row) acc += dout[long(r) * c + x];
  }
  dwte[i] = acc;
}
__global__ void embedding_backward_wpe_k(float* dwpe, const float* dout, int b, int t, int c) {
  const long i = blockIdx.x * long(blockDim.x) + threadIdx.x;
  if (i >= long(t) * c) return;
  const int pos = int(i / c), x = int(i % c);
  for (int r = 0; r < b; ++r) dwpe[i] += dout[(long(r) * t + pos) * c + x];
}

// Warp per row: the 32 lanes load and store a row's elements side by side (coalesced), and a
// reduction over the row folds the lanes' values one lane at a time, in element order: the
// same sequence of operations as the CPU's loop, so the same bits, and every lane ends with
// the result. (A tree reduction would be faster and change the bits.)
struct lane_of_row {
  long row;
  int lane;
};
__device__ lane_of_row warp_row() {
  const long t = blockIdx.x * long(blockDim.x) + threadIdx.x;
  return {t / 32, int(t % 32)};
}
int warp_blocks(long rows) {
  return blocks(rows * 32);
}
// acc folded with the values v of lanes 0..count-1, in lane order
template <class T, class F>
__device__ T fold_lanes(T acc, T v, int count, F f) {
  for (int k = 0; k < count; ++k) acc = f(acc, __shfl_sync(0xffffffffu, v, k));
  return acc;
}
__device__ double plus(double a, double b) {
  return a + b;
}
__device__ float max_of(float a, float b) {
  return fmaxf(a, b);
}
// Sum over j < n of term(j) in fp64, in j order.
template <class F>
__device__ double row_sum(int lane, int n, F term) {
  double s = 0.0;
  for (int j0 = 0; j0 < n; j0 += 32) {
    const int j = j0 + lane;
    s = fold_lanes(s, j < n ? term(j) : 0.0, min(32, n - j0), plus);
  }
  return s;
}
__device__ float row_max(int lane, int n, const float* v) {
  float m = -INFINITY;
  for (int j0 = 0; j0 < n; j0 += 32) {
    const int j = j0 + lane;
    m = fold_lanes(m, j < n ? v[j] : -INFINITY, min(32, n - j0), max_of);
  }
  return m;
}

__global__ void rmsnorm_forward_k(float* out, float* rstd, const float* x, const float* w, long n,
                                  int c) {
  const auto [i, lane] = warp_row();
  if (i >= n) return;  // warp-uniform
  const float* xi = x + i * c;
  const double ss = row_sum(lane, c, [xi](int j) { return double(xi[j]) * xi[j]; });
  const float r = float(1.0 / sqrt(ss / c + cpu::rmsnorm_eps));
  if (lane == 0) rstd[i] = r;
  for (int j = lane; j < c; j += 32) out[i * c + j] = (xi[j] * r) * w[j];
}
__global__ void rmsnorm_backward_dx_k(float* dx, const float* dout, const float* x, const float* w,
                                      const float* rstd, long n, int c) {
  const auto [i, lane] = warp_row();
  if (i >= n) return;
  const float* xi = x + i * c;
  const float* di = dout + i * c;
  const float r = rstd[i];
  const double dot =
      row_sum(lane, c, [=](int j) { return double(di[j] * w[j]) * double(xi[j] * r); });
  const float mean = float(dot / c);
  for (int j = lane; j < c; j += 32) dx[i * c + j] = r * (di[j] * w[j] - (xi[j] * r) * mean);
}
// dw[j] += the rows' products in row order, as the CPU adds them. A block takes 32 channels:
// its 8 warps compute a tile of rows' products into shared memory side by side (coalesced),
// then warp 0 adds the tile's rows in order, one lane per channel, in a register.
constexpr int dw_tile_rows = 256;
__global__ void rmsnorm_backward_dw_k(float* dw, const float* __restrict__ dout,
                                      const float* __restrict__ x, const float* __restrict__ rstd,
                                      int n, int c) {
  __shared__ float tile[dw_tile_rows][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int j = blockIdx.x * 32 + lane;
  float acc = warp == 0 && j < c ? dw[j] : 0.0f;
  for (int i0 = 0; i0 < n; i0 += dw_tile_rows) {
    for (int r = warp; r < dw_tile_rows; r += warps) {
      const long i = i0 + r;
      tile[r][lane] = i < n && j < c ? dout[i * c + j] * (x[i * c + j] * rstd[i]) : 0.0f;
    }
    __syncthreads();
    if (warp == 0) {
      const int rows = min(dw_tile_rows, n - i0);
#pragma unroll 8
      for (int r = 0; r < rows; ++r) acc += tile[r][lane];
    }
    __syncthreads();
  }
  if (warp == 0 && j < c) dw[j] = acc;
}

// Causal softmax of each [T] row of scores in place; zero above the diagonal.
__global__ void causal_softmax_k(float* att, long rows, int t) {
  const auto [i, lane] = warp_row();
  if (i >= rows) return;
  const int len = int(i % t) + 1;
  float* row = att + i * t;
  const float mx = row_max(lane, len, row);
  const double sum = row_sum(lane, len, [=](int j) {
    row[j] = expf(row[j] - mx);
    return double(row[j]);
  });
  const float inv = float(1.0 / sum);
  for (int j = lane; j < t; j += 32) row[j] = j < len ? row[j] * inv : 0.0f;
}
__global__ void causal_softmax_backward_k(float* ds, const float* att, long rows, int t) {
  const auto [i, lane] = warp_row();
  if (i >= rows) return;
  const int len = int(i % t) + 1;
  float* d = ds + i * t;
  const float* a = att + i * t;
  const float dd = float(row_sum(lane, len, [=](int j) { return double(a[j]) * d[j]; }));
  for (int j = lane; j < t; j += 32) d[j] = j < len ? a[j] * (d[j] - dd) : 0.0f;
}
// The CPU's polynomial exp (kernels.cpp), operation for operation; with --fmad=false the bits
// are the CPU's.
__device__ float exp_poly(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = (y * (r * r) + r) + 1.0f;
  return y * __int_as_float((int(n) + 127) << 23);
}
constexpr float gelu_s = 0.7978845608028654f;
constexpr float gelu_a = 0.044715f;

__global__ void gelu_forward_k(float* out, const float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  const float u = gelu_s * (v + gelu_a * v * v * v);
  out[i] = v / (1.0f + exp_poly(-2.0f * u));
}
__global__ void gelu_backward_k(float* dx, const float* dout, const float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  const float u = gelu_s * (v + gelu_a * v * v * v);
  const float s = 1.0f / (1.0f + exp_poly(-2.0f * u));
  const float du = gelu_s * (1.0f + 3.0f * gelu_a * v * v);
  dx[i] = (s + 2.0f * v * s * (1.0f - s) * du) * dout[i];
}

__global__ void softmax_xent_forward_k(float* losses, float* probs, const float* logits,
                                       const std::int32_t* targets, long n, int v) {
  const auto [i, lane] = warp_row();
  if (i >= n) return;
  const float* l = logits + i * v;
  float* p = probs + i * v;
  const float mx = row_max(lane, v, l);
  const double sum = row_sum(lane, v, [=](int j) {
    p[j] = expf(l[j] - mx);
    return double(p[j]);
  });
  const float inv = float(1.0 / sum);
  for (int j = lane; j < v; j += 32) p[j] *= inv;
  if (lane == 0) losses[i] = float(log(sum) + mx - l[targets[i]]);
}
__global__ void softmax_xent_backward_k(float* dlogits, const float* probs,
                                        const std::int32_t* targets, float dloss, int n, int v) {
  const long i = blockIdx.x * long(blockDim.x) + threadIdx.x;
  if (i >= long(n) * v) return;
  const long row = i / v;
  const int j = int(i % v);
  dlogits[i] = (probs[i] - (j == targets[row] ? 1.0f : 0.0f)) * dloss;
}

void launched(const char* what) {
  check(cudaGetLastError(), what);
}

// One thread per token for everything below: a token's slots are visited in slot order and no
// output element is written by two threads.
__global__ void gate_backward_k(float* dlogits, const float* probs, const std::int32_t* expert,
                                const float* dweight, const std::int32_t* routed, float daux, int n,
                                int e, int k) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  // dp[j] = aux gradient + combine-weight gradients of the slots that chose j (CPU order)
  const float* p = probs + long(i) * e;
  float* dl = dlogits + long(i) * e;
  for (int j = 0; j < e; ++j) {
    dl[j] = float(double(daux) * e * (double(routed[j]) / (double(n) * k)) / n);
  }
  for (int s = 0; s < k; ++s) dl[expert[long(i) * k + s]] += dweight[long(i) * k + s];
  double dot = 0.0;
  for (int j = 0; j < e; ++j) dot += double(p[j]) * dl[j];
  const float d = float(dot);
  for (int j = 0; j < e; ++j) dl[j] = p[j] * (dl[j] - d);
}
__global__ void moe_gather_k(float* xs, const float* x, const std::int32_t* token, int rows,
                             int c) {
  const long i = blockIdx.x * long(blockDim.x) + threadIdx.x;
  if (i >= long(rows) * c) return;
  xs[i] = x[long(token[i / c]) * c + i % c];
}
__global__ void moe_combine_forward_k(float* out, const float* ye, const std::int32_t* row,
                                      const float* weight, int n, int k, int c) {
  const long i = blockIdx.x * long(blockDim.x) + threadIdx.x;
  if (i >= long(n) * c) return;
  const long tok = i / c;
  const int x = int(i % c);
  float o = 0.0f;
  for (int s = 0; s < k; ++s) {
    const int r = row[tok * k + s];
    if (r >= 0) o += weight[tok * k + s] * ye[long(r) * c + x];
  }
  out[i] = o;
}
__global__ void moe_combine_backward_k(float* dye, float* dweight, const float* dout,
                                       const float* ye, const std::int32_t* row,
                                       const float* weight, long n, int k, int c) {
  const auto [i, lane] = warp_row();
  if (i >= n) return;
  const float* d = dout + i * c;
  for (int s = 0; s < k; ++s) {
    const int r = row[i * k + s];
    if (r < 0) {
      if (lane == 0) dweight[i * k + s] = 0.0f;
      continue;
    }
    const float w = weight[i * k + s];
    float* dy = dye + long(r) * c;
    const float* y = ye + long(r) * c;
    const double dot = row_sum(lane, c, [=](int x) {
      dy[x] = w * d[x];
      return double(d[x]) * y[x];
    });
    if (lane == 0) dweight[i * k + s] = float(dot);
  }
}
__global__ void moe_scatter_add_k(float* dx, const float* dxs, const std::int32_t* row, int n,
                                  int k, int c) {
  const long i = blockIdx.x * long(blockDim.x) + threadIdx.x;
  if (i >= long(n) * c) return;
  const long tok = i / c;
  float acc = dx[i];
  for (int s = 0; s < k; ++s) {
    const int r = row[tok * k + s];
    if (r >= 0) acc += dxs[long(r) * c + i % c];
  }
  dx[i] = acc;
}

}  // namespace

void matmul_forward(context& ctx, float* out, const float* x, const float* w, int n, int in,
                    int out_dim) {
  if (n == 0) return;
  gemm(ctx, false, false, n, out_dim, in, 1.0f, x, in, 0, w, out_dim, 0, 0.0f, out, out_dim, 0, 1);
}

void matmul_backward(context& ctx, float* dx, float* dw, const float* dout, const float* x,
                     const float* w, int n, int in, int out_dim) {
  if (n == 0) return;
  if (dx != nullptr) {
    gemm(ctx, false, true, n, in, out_dim, 1.0f, dout, out_dim, 0, w, out_dim, 0, 0.0f, dx, in, 0,
         1);
  }
  if (dw != nullptr) {
    gemm(ctx, true, false, in, out_dim, n, 1.0f, x, in, 0, dout, out_dim, 0, 1.0f, dw, out_dim, 0,
         1);
  }
}

void embedding_forward(context& ctx, float* out, const std::int32_t* tokens, const float* wte,
                       const float* wpe, int b, int t, int c) {
  const long n = long(b) * t * c;
  embedding_forward_k<<<blocks(n), block, 0, ctx.get().stream>>>(out, tokens, wte, wpe, b, t, c);
  launched("embedding_forward");
}

void embedding_backward(context& ctx, float* dwte, float* dwpe, const float* dout,
                        const std::int32_t* tokens, int b, int t, int c, int embedding_vocab) {
  if (dwte != nullptr) {
    // thread per (vocab row, channel): each element sums its tokens in (b, t) order, as the CPU
    embedding_backward_wte_k<<<blocks(long(embedding_vocab) * c), block, 0, ctx.get().stream>>>(
        dwte, dout, tokens, b * t, embedding_vocab, c);
    launched("embedding_backward(wte)");
  }
  if (dwpe != nullptr) {
    embedding_backward_wpe_k<<<blocks(long(t) * c), block, 0, ctx.get().stream>>>(dwpe, dout, b, t,
                                                                                  c);
    launched("embedding_backward(wpe)");
  }
}

void rmsnorm_forward(context& ctx, float* out, float* rstd, const float* x, const float* w, int n,
                     int c) {
  rmsnorm_forward_k<<<warp_blocks(n), block, 0, ctx.get().stream>>>(out, rstd, x, w, n, c);
  launched("rmsnorm_forward");
}

void rmsnorm_backward(context& ctx, float* dx, float* dw, const float* dout, const float* x,
                      const float* w, const float* rstd, int n, int c) {
  rmsnorm_backward_dx_k<<<warp_blocks(n), block, 0, ctx.get().stream>>>(dx, dout, x, w, rstd, n, c);
  launched("rmsnorm_backward(dx)");
  if (dw != nullptr) {
    rmsnorm_backward_dw_k<<<unsigned((c + 31) / 32), block, 0, ctx.get().stream>>>(dw, dout, x,
                                                                                   rstd, n, c);
    launched("rmsnorm_backward(dw)");
  }
}

void attention_forward(context& ctx, float* y, float* att, const float* qkv, int b, int t, int c,
                       int nh) {
  const int hs = c / nh, c3 = 3 * c;
  const float scale = 1.0f / sqrtf(float(hs));
  const long tt = long(t) * t;
  for (int i = 0; i < b; ++i) {
    const float* base = qkv + long(i) * t * c3;
    // scores[h] [T,T] = scale q_h k_h^T, batched over heads
    gemm(ctx, false, true, t, t, hs, scale, base, c3, hs, base + c, c3, hs, 0.0f,
         att + long(i) * nh * tt, t, tt, nh);
  }
  // one launch over the rows of every sequence and head (per sequence, too few threads)
  causal_softmax_k<<<warp_blocks(long(b) * nh * t), block, 0, ctx.get().stream>>>(
      att, long(b) * nh * t, t);
  launched("causal_softmax");
  for (int i = 0; i < b; ++i) {
    // y_h [T,hs] = att_h v_h
    gemm(ctx, false, false, t, hs, t, 1.0f, att + long(i) * nh * tt, t, tt,
         qkv + long(i) * t * c3 + 2 * c, c3, hs, 0.0f, y + long(i) * t * c, c, hs, nh);
  }
}

void attention_backward(context& ctx, float* dqkv, float* scratch, const float* dy,
                        const float* att, const float* qkv, int b, int t, int c, int nh) {
  const int hs = c / nh, c3 = 3 * c;
  const float scale = 1.0f / sqrtf(float(hs));
  const long tt = long(t) * t;
  for (int i = 0; i < b; ++i) {
    const float* base = qkv + long(i) * t * c3;
    float* dbase = dqkv + long(i) * t * c3;
    const float* a = att + long(i) * nh * tt;
    const float* dyb = dy + long(i) * t * c;
    gemm(ctx, false, true, t, t, hs, 1.0f, dyb, c, hs, base + 2 * c, c3, hs, 0.0f,
         scratch + long(i) * nh * tt, t, tt, nh);  // datt = dy_h v_h^T
    gemm(ctx, true, false, t, hs, t, 1.0f, a, t, tt, dyb, c, hs, 0.0f, dbase + 2 * c, c3, hs,
         nh);  // dv = att^T dy_h
  }
  causal_softmax_backward_k<<<warp_blocks(long(b) * nh * t), block, 0, ctx.get().stream>>>(
      scratch, att, long(b) * nh * t, t);
  launched("causal_softmax_backward");
  for (int i = 0; i < b; ++i) {
    const float* base = qkv + long(i) * t * c3;
    float* dbase = dqkv + long(i) * t * c3;
    const float* ds = scratch + long(i) * nh * tt;
    gemm(ctx, false, false, t, hs, t, scale, ds, t, tt, base + c, c3, hs, 0.0f, dbase, c3, hs,
         nh);  // dq = scale ds k
    gemm(ctx, true, false, t, hs, t, scale, ds, t, tt, base, c3, hs, 0.0f, dbase + c, c3, hs,
         nh);  // dk = scale ds^T q
  }
}

void gelu_forward(context& ctx, float* out, const float* x, int n) {
  gelu_forward_k<<<blocks(n), block, 0, ctx.get().stream>>>(out, x, n);
  launched("gelu_forward");
}

void gelu_backward(context& ctx, float* dx, const float* dout, const float* x, int n) {
  gelu_backward_k<<<blocks(n), block, 0, ctx.get().stream>>>(dx, dout, x, n);
  launched("gelu_backward");
}

void softmax_xent_forward(context& ctx, float* losses, float* probs, const float* logits,
                          const std::int32_t* targets, int n, int v) {
  softmax_xent_forward_k<<<warp_blocks(n), block, 0, ctx.get().stream>>>(losses, probs, logits,
                                                                         targets, n, v);
  launched("softmax_xent_forward");
}

void gate_forward(context& ctx, device_routing& r, const float* logits, int n, int e, int k,
                  double capacity_factor) {
  std::vector<float> host(std::size_t(n) * e);
  check(cudaMemcpyAsync(host.data(), logits, host.size() * sizeof(float), cudaMemcpyDeviceToHost,
                        ctx.get().stream),
        "cudaMemcpyAsync");
  ctx.synchronize();
  cpu::gate_forward(r.host, host.data(), n, e, k, capacity_factor);
  auto up = [&ctx](auto& dst, const auto& src) {
    using T = typename std::decay_t<decltype(src)>::value_type;
    if (!dst || dst->size() != src.size()) dst = std::make_unique<device_array<T>>(ctx, src.size());
    dst->upload(src);
  };
  up(r.probs, r.host.probs);
  up(r.weight, r.host.weight);
  up(r.expert, r.host.expert);
  up(r.row, r.host.row);
  up(r.token, r.host.token);
  up(r.routed, r.host.routed);
}

void gate_backward(context& ctx, float* dlogits, const device_routing& r, const float* dweight,
                   float daux) {
  const auto& h = r.host;
  gate_backward_k<<<blocks(h.n), block, 0, ctx.get().stream>>>(
      dlogits, r.probs->data(), r.expert->data(), dweight, r.routed->data(), daux, h.n, h.e, h.k);
  launched("gate_backward");
}

void moe_gather(context& ctx, float* xs, const float* x, const device_routing& r, int c) {
  const int rows = r.host.rows();
  if (rows == 0) return;
  moe_gather_k<<<blocks(long(rows) * c), block, 0, ctx.get().stream>>>(xs, x, r.token->data(), rows,
                                                                       c);
  launched("moe_gather");
}

void moe_combine_forward(context& ctx, float* out, const float* ye, const device_routing& r,
                         int c) {
  const auto& h = r.host;
  moe_combine_forward_k<<<blocks(long(h.n) * c), block, 0, ctx.get().stream>>>(
      out, ye, r.row->data(), r.weight->data(), h.n, h.k, c);
  launched("moe_combine_forward");
}

void moe_combine_backward(context& ctx, float* dye, float* dweight, const float* dout,
                          const float* ye, const device_routing& r, int c) {
  const auto& h = r.host;
  moe_combine_backward_k<<<warp_blocks(h.n), block, 0, ctx.get().stream>>>(
      dye, dweight, dout, ye, r.row->data(), r.weight->data(), h.n, h.k, c);
  launched("moe_combine_backward");
}

void moe_scatter_add(context& ctx, float* dx, const float* dxs, const device_routing& r, int c) {
  const auto& h = r.host;
  moe_scatter_add_k<<<blocks(long(h.n) * c), block, 0, ctx.get().stream>>>(dx, dxs, r.row->data(),
                                                                           h.n, h.k, c);
  launched("moe_scatter_add");
}

void softmax_xent_backward(context& ctx, float* dlogits, const float* probs,
                           const std::int32_t* targets, float dloss, int n, int v) {
  softmax_xent_backward_k<<<blocks(long(n) * v), block, 0, ctx.get().stream>>>(
      dlogits, probs, targets, dloss, n, v);
  launched("softmax_xent_backward");
}

namespace {

__global__ void add_k(float* out, const float* a, const float* b, long n) {
  const long i = blockIdx.x * long(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}

// tensor.cpp's f32_to_f16 / f16_to_f32 / f32_to_bf16, line for line.
__device__ std::uint16_t to_f16(float f) {
  const std::uint32_t x = __float_as_uint(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return std::uint16_t(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return std::uint16_t(sign | 0x7c00u);
  if (ax < 0x38800000u) {
    const float scaled = __uint_as_float(ax) * 16777216.0f;
    return std::uint16_t(sign | std::uint32_t(rintf(scaled)));
  }
  const std::uint32_t mant = ax & 0x7fffffu;
  const std::uint32_t exp = (ax >> 23) - 127 + 15;
  std::uint32_t h = (exp << 10) | (mant >> 13);
  const std::uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return std::uint16_t(sign | h);
}
__device__ float from_f16(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = float(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  if (exp == 31) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
  return __uint_as_float(sign | ((exp + 112) << 23) | (mant << 13));
}
__device__ float round_bf16(float f) {
  const std::uint32_t x = __float_as_uint(f);
  std::uint32_t h;
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    h = (x >> 16) | 0x40u;
  } else {
    h = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  }
  return __uint_as_float((h & 0xffffu) << 16);
}

__global__ void round_to_compute_k(float* w, const float* master, long n, int kind) {
  const long i = blockIdx.x * long(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float x = master[i];
  w[i] = kind == 0 ? x : kind == 1 ? from_f16(to_f16(x)) : round_bf16(x);
}

__global__ void compute_bytes_k(void* dst, const float* master, long n, int kind) {
  const long i = blockIdx.x * long(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float x = master[i];
  if (kind == 0) {
    static_cast<float*>(dst)[i] = x;
  } else if (kind == 1) {
    static_cast<std::uint16_t*>(dst)[i] = to_f16(x);
  } else {
    static_cast<std::uint16_t*>(dst)[i] = std::uint16_t(__float_as_uint(round_bf16(x)) >> 16);
  }
}

// operator_state::adamw_step's scalar loop; --fmad=false keeps every product and sum separate.
__global__ void adamw_k(float* w, float* m, float* v, const float* grad, long n, adamw_scalars s) {
  const long j = blockIdx.x * long(blockDim.x) + threadIdx.x;
  if (j >= n) return;
  const float one_b1 = 1.0f - s.beta1, one_b2 = 1.0f - s.beta2;
  const float g = grad[j] * s.grad_mul;
  const float mj = s.beta1 * m[j] + one_b1 * g;
  const float vj = s.beta2 * v[j] + one_b2 * (g * g);
  m[j] = mj;
  v[j] = vj;
  const float mhat = mj / s.bc1;
  const float vhat = vj / s.bc2;
  const float wj = w[j];
  w[j] = wj - s.lr * (mhat / (sqrtf(vhat) + s.eps) + s.weight_decay * wj);
}

// One block per gradient. Partial l of the CPU's 8 is the sum, in order, of the squares of the
// elements j = l mod 8 below the last multiple of 8. The block squares a tile of elements into
// shared memory side by side; then threads 0..7 each add their partial's share of the tile in
// order; at the end thread 0 adds the partials in order, then the tail.
constexpr int sq_tile = 2048;
__global__ void sum_squares_k(double* out, const float* const* grads, const long* sizes) {
  __shared__ double tile[sq_tile];
  __shared__ double part[8];
  const float* __restrict__ g = grads[blockIdx.x];
  const long n = sizes[blockIdx.x], whole = n - n % 8;
  const int tid = threadIdx.x;
  double s = 0.0;
  for (long j0 = 0; j0 < whole; j0 += sq_tile) {
    const int len = int(min(long(sq_tile), whole - j0));  // a multiple of 8
    for (int k = tid; k < len; k += blockDim.x) tile[k] = double(g[j0 + k]) * double(g[j0 + k]);
    __syncthreads();
    if (tid < 8) {
#pragma unroll 8
      for (int k = tid; k < len; k += 8) s += tile[k];
    }
    __syncthreads();
  }
  if (tid < 8) part[tid] = s;
  __syncthreads();
  if (tid != 0) return;
  double total = 0.0;
  for (int l = 0; l < 8; ++l) total += part[l];
  for (long j = whole; j < n; ++j) total += double(g[j]) * double(g[j]);
  out[blockIdx.x] = total;
}

}  // namespace

void copy_to_device(context& ctx, void* dst, const void* src, std::size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx.get().stream),
        "cudaMemcpyAsync(to device)");
}
void copy_to_host(context& ctx, void* dst, const void* src, std::size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx.get().stream),
        "cudaMemcpyAsync(to host)");
  ctx.synchronize();
}
void copy_on_device(context& ctx, void* dst, const void* src, std::size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx.get().stream),
        "cudaMemcpyAsync(on device)");
}
void fill_zero(context& ctx, void* dst, std::size_t bytes) {
  check(cudaMemsetAsync(dst, 0, bytes, ctx.get().stream), "cudaMemsetAsync");
}

void add(context& ctx, float* out, const float* a, const float* b, long n) {
  if (n == 0) return;
  add_k<<<blocks(n), block, 0, ctx.get().stream>>>(out, a, b, n);
  launched("add");
}

void round_to_compute(context& ctx, float* weights, const float* master, long n, dtype compute) {
  if (n == 0) return;
  const int kind = compute == dtype::f32 ? 0 : compute == dtype::f16 ? 1 : 2;
  round_to_compute_k<<<blocks(n), block, 0, ctx.get().stream>>>(weights, master, n, kind);
  launched("round_to_compute");
}

struct copy_stream::impl {
  cudaStream_t stream = nullptr;
  cudaEvent_t marked = nullptr;
  // recorded after the copies; waited on by blocking, not spinning: the capture thread that
  // waits shares the host's cores with the stages
  cudaEvent_t done = nullptr;
};

copy_stream::copy_stream(context& ctx) : ctx_(ctx), impl_(std::make_unique<impl>()) {
  ctx.get();
  check(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaEventCreateWithFlags(&impl_->marked, cudaEventDisableTiming), "cudaEventCreate");
  check(cudaEventCreateWithFlags(&impl_->done, cudaEventDisableTiming | cudaEventBlockingSync),
        "cudaEventCreate");
  mark();  // nothing queued yet: a copy before the first mark waits for nothing
}

copy_stream::~copy_stream() {
  ctx_.get();
  (void)cudaStreamSynchronize(impl_->stream);  // no copy may outlive its destination's owner
  (void)cudaEventDestroy(impl_->marked);
  (void)cudaEventDestroy(impl_->done);
  (void)cudaStreamDestroy(impl_->stream);
}

void copy_stream::mark() {
  check(cudaEventRecord(impl_->marked, ctx_.get().stream), "cudaEventRecord");
}

void copy_stream::copy_to_host(void* dst, const void* src, std::size_t bytes) {
  ctx_.get();
  check(cudaStreamWaitEvent(impl_->stream, impl_->marked, 0), "cudaStreamWaitEvent");
  // In pieces: the copy engine takes the compute stream's own transfers (the boundary
  // tensors, on the pipeline's critical path) between two pieces, not after a whole slot.
  auto* to = static_cast<std::byte*>(dst);
  const auto* from = static_cast<const std::byte*>(src);
  for (std::size_t at = 0; at < bytes; at += copy_piece_bytes) {
    check(cudaMemcpyAsync(to + at, from + at, std::min(copy_piece_bytes, bytes - at),
                          cudaMemcpyDeviceToHost, impl_->stream),
          "cudaMemcpyAsync(side stream to host)");
  }
}

void copy_stream::compute_bytes(void* dst, const float* master, long n, dtype compute) {
  if (n == 0) return;
  ctx_.get();
  check(cudaStreamWaitEvent(impl_->stream, impl_->marked, 0), "cudaStreamWaitEvent");
  const int kind = compute == dtype::f32 ? 0 : compute == dtype::f16 ? 1 : 2;
  compute_bytes_k<<<blocks(n), block, 0, impl_->stream>>>(dst, master, n, kind);
  launched("compute_bytes");
}

void copy_stream::synchronize() {
  ctx_.get();
  check(cudaEventRecord(impl_->done, impl_->stream), "cudaEventRecord");
  check(cudaEventSynchronize(impl_->done), "cudaEventSynchronize(side stream)");
}

// The callers go on without the memory (pageable memory, or the heap) when these fail, so a
// failure must not stay behind as the thread's last CUDA error: the next kernel launch's
// check would report it as its own.
std::shared_ptr<void> pin_host_memory(context& ctx, std::span<std::byte> bytes) {
  ctx.get();
  if (const auto e = cudaHostRegister(bytes.data(), bytes.size(), cudaHostRegisterDefault);
      e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("cudaHostRegister: ") + cudaGetErrorString(e));
  }
  const int device = ctx.device();
  return std::shared_ptr<void>(bytes.data(), [device](void* p) {
    (void)cudaSetDevice(device);
    if (cudaHostUnregister(p) != cudaSuccess) (void)cudaGetLastError();
  });
}

std::shared_ptr<std::byte[]> alloc_pinned(context& ctx, std::size_t n) {
  ctx.get();
  void* p = nullptr;
  if (const auto e = cudaMallocHost(&p, std::max<std::size_t>(n, 1)); e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("cudaMallocHost: ") + cudaGetErrorString(e));
  }
  return std::shared_ptr<std::byte[]>(static_cast<std::byte*>(p), [](std::byte* q) {
    if (cudaFreeHost(q) != cudaSuccess) (void)cudaGetLastError();
  });
}

void adamw_step(context& ctx, float* w, float* m, float* v, const float* grad, long n,
                const adamw_scalars& s) {
  if (n == 0) return;
  adamw_k<<<blocks(n), block, 0, ctx.get().stream>>>(w, m, v, grad, n, s);
  launched("adamw_step");
}

void sum_squares(context& ctx, double* out, std::span<const float* const> grads,
                 std::span<const long> sizes) {
  if (grads.size() != sizes.size()) throw std::invalid_argument("sum_squares: sizes differ");
  if (grads.empty()) return;
  // the pointer and size tables, in one small allocation freed once the kernel has read them
  const std::size_t table = grads.size() * (sizeof(float*) + sizeof(long));
  void* dev = nullptr;
  check(cudaMallocAsync(&dev, table, ctx.get().stream), "cudaMallocAsync");
  struct table_guard {  // freed on every path (a failed copy or launch throws)
    void* p;
    cudaStream_t s;
    ~table_guard() { cudaFreeAsync(p, s); }
  } guard{dev, ctx.get().stream};
  auto* d_grads = static_cast<const float**>(dev);
  auto* d_sizes = reinterpret_cast<long*>(static_cast<char*>(dev) + grads.size() * sizeof(float*));
  copy_to_device(ctx, d_grads, grads.data(), grads.size() * sizeof(float*));
  copy_to_device(ctx, d_sizes, sizes.data(), sizes.size() * sizeof(long));
  sum_squares_k<<<unsigned(grads.size()), block, 0, ctx.get().stream>>>(out, d_grads, d_sizes);
  launched("sum_squares");
  ctx.synchronize();  // the host tables must outlive the copies
}

void sgemm(context& ctx, bool ta, bool tb, int m, int n, int k, const float* a, int lda,
           const float* b, int ldb, float beta, float* c, int ldc, long stride_a, long stride_b,
           long stride_c, int batch) {
  gemm(ctx, ta, tb, m, n, k, 1.0f, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc, stride_c,
       batch);
}

}  // namespace moevement::models::cuda
