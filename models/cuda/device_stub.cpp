// Built instead of device.cu when CUDA is not compiled in: says so, never pretends.
#include <stdexcept>

#include "models/cuda/device.hpp"

namespace moevement::models::cuda {

bool compiled() {
  return false;
}
int device_count() {
  return 0;
}
std::vector<float> saxpy(float, const std::vector<float>&, const std::vector<float>&) {
  throw std::runtime_error("this build has no CUDA backend; reconfigure with -Dcuda=enabled");
}
void prewarm() {}
std::string describe_device() {
  return "CUDA backend not compiled in";
}
std::string open_cublaslt() {
  return "CUDA backend not compiled in";
}

}  // namespace moevement::models::cuda
