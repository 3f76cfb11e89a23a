// Built instead of collectives.cu when CUDA is not compiled in: every entry point says so.
#include <stdexcept>

#include "models/cuda/collectives.hpp"

namespace moevement::models::cuda {
namespace {
[[noreturn]] void missing_nccl() {
  throw std::runtime_error(
      "this build has no CUDA backend (NCCL); reconfigure with -Dcuda=enabled");
}
}  // namespace

std::vector<std::byte> new_group_id() {
  missing_nccl();
}
nccl_group::nccl_group(context& ctx, std::span<const std::byte>, int, int) : ctx_(ctx) {
  missing_nccl();
}
nccl_group::~nccl_group() = default;
double nccl_group::abort() {
  return 0.0;
}
wait_result nccl_group::wait_queued(const std::atomic<bool>&, clock::time_point, bool) {
  missing_nccl();
}
wait_result nccl_group::wait_formed(clock::time_point, const std::atomic<bool>&) {
  missing_nccl();
}
wait_result nccl_group::sum(std::span<const std::span<float>>, const std::atomic<bool>&) {
  missing_nccl();
}

}  // namespace moevement::models::cuda
