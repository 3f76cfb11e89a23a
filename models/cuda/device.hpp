// The CUDA side, as seen from host code that must also build without CUDA.
#pragma once

#include <string>
#include <vector>

namespace moevement::models::cuda {

// True when this build has the CUDA backend compiled in.
bool compiled();
// Visible GPUs; 0 without CUDA or without a device (never throws).
int device_count();
// y[i] = a * x[i] + y[i] on device 0; for checking that kernels run. Throws without a GPU.
std::vector<float> saxpy(float a, const std::vector<float>& x, const std::vector<float>& y);
// Creates the CUDA runtime's context on every visible device (what the first CUDA call of a
// process otherwise pays, a large share of a second): a spare does it while it idles, so that
// a stage rebuilt on it starts computing sooner. Never throws; without a GPU it does nothing.
// GPUs not in the default compute mode (exclusive-process, prohibited) are left alone: a
// context there would keep a worker off them.
void prewarm();
// "<name> (sm_XY)" of device 0, or why there is none.
std::string describe_device();
// Opens cuBLASLt if it is not open yet (it is loaded on first use, never at a process's start:
// models/cuda/cublaslt_loader.cpp) and says why it cannot be: empty when it is open.
std::string open_cublaslt();

}  // namespace moevement::models::cuda
