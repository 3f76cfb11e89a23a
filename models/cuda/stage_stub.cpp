// Built instead of stage.cpp when CUDA is not compiled in: constructing one says so.
#include <stdexcept>

#include "models/cuda/stage.hpp"

namespace moevement::models::cuda {

void step_operator(context&, operator_state&, float*, float*, float*, const float*, float*,
                   const adamw_config&, float) {
  throw config_error("train.device", "this build has no CUDA backend");
}

struct stage::impl {};

stage::stage(context&, moe_model&, stage_range range, int micro_batch_size, int seq_len)
    : range_(range), b_(micro_batch_size), t_(seq_len) {
  throw config_error("train.device",
                     "'cuda' needs a build with the CUDA backend (reconfigure with "
                     "-Dcuda=enabled where the CUDA toolkit is installed), or set it to 'cpu'");
}
stage::~stage() = default;
void stage::warm_up() {}
void stage::upload_weights() {}
void stage::zero_grads() {}
void stage::download_grads() {}
float* stage::weights(std::size_t) {
  return nullptr;
}
float* stage::grads(std::size_t) {
  return nullptr;
}
models::stage::forward_result stage::forward(int, const std::int32_t*, const float*,
                                             const std::int32_t*, bool) {
  return {};
}
std::span<const float> stage::backward(int, const float*, float) {
  return {};
}
std::size_t stage::in_flight() const {
  return 0;
}
void stage::abort() {}
void stage::prepare() {}
void stage::step(const step_plan&, const adamw_config&, bool) {}
bool stage::state_on_device() const {
  return false;
}
void stage::sync_to_host() {}
std::vector<double> stage::grad_sq_sums() {
  return {};
}
void stage::host_changed() {}
void stage::copy_out(std::size_t, tensor, std::span<std::byte>) {}
void stage::wait_copies() {}
std::shared_ptr<void> stage::pin(std::span<std::byte>) {
  return nullptr;
}
std::shared_ptr<std::byte[]> stage::alloc_pinned(std::size_t) {
  return nullptr;
}
double stage::time_copy(std::span<std::byte>) {
  return 0.0;
}

}  // namespace moevement::models::cuda
