#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "models/cuda/check.hpp"
#include "models/cuda/device.hpp"

namespace moevement::models::cuda {
namespace {

// One thread per element; no atomics, so the result is bitwise reproducible.
__global__ void saxpy_kernel(int n, float a, const float* x, float* y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __fadd_rn(__fmul_rn(a, x[i]), y[i]);
}

}  // namespace

bool compiled() {
  return true;
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

std::vector<float> saxpy(float a, const std::vector<float>& x, const std::vector<float>& y) {
  if (x.size() != y.size()) throw std::invalid_argument("saxpy: x and y differ in length");
  const int n = static_cast<int>(x.size());
  float* dx = nullptr;
  float* dy = nullptr;
  check(cudaMalloc(&dx, n * sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&dy, n * sizeof(float)), "cudaMalloc");
  std::vector<float> out(n);
  try {
    check(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
    check(cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
    saxpy_kernel<<<(n + 255) / 256, 256>>>(n, a, dx, dy);
    check(cudaGetLastError(), "saxpy launch");
    check(cudaMemcpy(out.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
  } catch (...) {
    cudaFree(dx);
    cudaFree(dy);
    throw;
  }
  cudaFree(dx);
  cudaFree(dy);
  return out;
}

void prewarm() {
  const int n = device_count();
  for (int d = 0; d < n; ++d) {
    // A context here would lock a worker out of a GPU in exclusive-process mode (the query
    // makes none).
    int mode = cudaComputeModeDefault;
    if (cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, d) != cudaSuccess ||
        mode != cudaComputeModeDefault) {
      (void)cudaGetLastError();
      continue;
    }
    if (cudaSetDevice(d) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {
      (void)cudaGetLastError();  // the stage built here later reports what is wrong
    }
  }
}

std::string describe_device() {
  if (device_count() == 0) return "no CUDA device visible";
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, 0), "cudaGetDeviceProperties");
  return std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ")";
}

}  // namespace moevement::models::cuda
