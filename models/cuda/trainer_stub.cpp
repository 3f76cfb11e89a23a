// Built instead of trainer.cpp when CUDA is not compiled in.
#include <stdexcept>

#include "models/cuda/trainer.hpp"

namespace moevement::models::cuda {

struct trainer::impl {};

trainer::trainer(const model_config&, const train_config&) {
  throw config_error("train.device",
                     "'cuda' needs a build with the CUDA backend (reconfigure with "
                     "-Dcuda=enabled where the CUDA toolkit is installed), or set it to 'cpu'");
}
trainer::~trainer() = default;
iteration_stats trainer::train_iteration() {
  return {};
}
double trainer::validation_loss() {
  return 0.0;
}
std::uint64_t trainer::state_hash() {
  return 0;
}
moe_model& trainer::model() {
  throw std::logic_error("cuda::trainer without a CUDA backend");
}
void trainer::sync_to_host() {}
std::int64_t trainer::tokens_per_iteration() const {
  return 0;
}

}  // namespace moevement::models::cuda
