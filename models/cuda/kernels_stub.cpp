// Built instead of kernels.cu when CUDA is not compiled in: every entry point says so.
#include <stdexcept>

#include "models/cuda/kernels.hpp"

namespace moevement::models::cuda {
namespace {
[[noreturn]] void missing_cuda() {
  throw std::runtime_error("this build has no CUDA backend; reconfigure with -Dcuda=enabled");
}
}  // namespace

struct context::impl {};
context::context(int) {
  missing_cuda();
}
int context::device() const {
  return 0;
}
context::impl& context::get() {
  missing_cuda();
}
void* context::stream() {
  missing_cuda();
}
context::~context() = default;
void context::synchronize() {
  missing_cuda();
}

template <class T>
device_array<T>::device_array(context& ctx, std::size_t) : ctx_(ctx) {
  missing_cuda();
}
template <class T>
device_array<T>::~device_array() = default;
template <class T>
void device_array<T>::upload(const std::vector<T>&) {
  missing_cuda();
}
template <class T>
std::vector<T> device_array<T>::download() const {
  missing_cuda();
}
template class device_array<float>;
template class device_array<std::int32_t>;
template class device_array<double>;

void matmul_forward(context&, float*, const float*, const float*, int, int, int) {
  missing_cuda();
}
void matmul_backward(context&, float*, float*, const float*, const float*, const float*, int, int,
                     int) {
  missing_cuda();
}
void embedding_forward(context&, float*, const std::int32_t*, const float*, const float*, int, int,
                       int) {
  missing_cuda();
}
void embedding_backward(context&, float*, float*, const float*, const std::int32_t*, int, int, int,
                        int) {
  missing_cuda();
}
void rmsnorm_forward(context&, float*, float*, const float*, const float*, int, int) {
  missing_cuda();
}
void rmsnorm_backward(context&, float*, float*, const float*, const float*, const float*,
                      const float*, int, int) {
  missing_cuda();
}
void attention_forward(context&, float*, float*, const float*, int, int, int, int) {
  missing_cuda();
}
void attention_backward(context&, float*, float*, const float*, const float*, const float*, int,
                        int, int, int) {
  missing_cuda();
}
void gelu_forward(context&, float*, const float*, int) {
  missing_cuda();
}
void gelu_backward(context&, float*, const float*, const float*, int) {
  missing_cuda();
}
void softmax_xent_forward(context&, float*, float*, const float*, const std::int32_t*, int, int) {
  missing_cuda();
}
void softmax_xent_backward(context&, float*, const float*, const std::int32_t*, float, int, int) {
  missing_cuda();
}

void gate_forward(context&, device_routing&, const float*, int, int, int, double) {
  missing_cuda();
}
void gate_backward(context&, float*, const device_routing&, const float*, float) {
  missing_cuda();
}
void moe_gather(context&, float*, const float*, const device_routing&, int) {
  missing_cuda();
}
void moe_combine_forward(context&, float*, const float*, const device_routing&, int) {
  missing_cuda();
}
void moe_combine_backward(context&, float*, float*, const float*, const float*,
                          const device_routing&, int) {
  missing_cuda();
}
void moe_scatter_add(context&, float*, const float*, const device_routing&, int) {
  missing_cuda();
}

void copy_to_device(context&, void*, const void*, std::size_t) {
  missing_cuda();
}
void copy_to_host(context&, void*, const void*, std::size_t) {
  missing_cuda();
}
void copy_on_device(context&, void*, const void*, std::size_t) {
  missing_cuda();
}
void fill_zero(context&, void*, std::size_t) {
  missing_cuda();
}
void add(context&, float*, const float*, const float*, long) {
  missing_cuda();
}
void round_to_compute(context&, float*, const float*, long, dtype) {
  missing_cuda();
}
void adamw_step(context&, float*, float*, float*, const float*, long, const adamw_scalars&) {
  missing_cuda();
}
void sum_squares(context&, double*, std::span<const float* const>, std::span<const long>) {
  missing_cuda();
}
void sgemm(context&, bool, bool, int, int, int, const float*, int, const float*, int, float, float*,
           int, long, long, long, int) {
  missing_cuda();
}

struct copy_stream::impl {};
copy_stream::copy_stream(context& ctx) : ctx_(ctx) {
  missing_cuda();
}
copy_stream::~copy_stream() = default;
void copy_stream::mark() {
  missing_cuda();
}
void copy_stream::copy_to_host(void*, const void*, std::size_t) {
  missing_cuda();
}
void copy_stream::compute_bytes(void*, const float*, long, dtype) {
  missing_cuda();
}
void copy_stream::synchronize() {
  missing_cuda();
}
std::shared_ptr<void> pin_host_memory(context&, std::span<std::byte>) {
  missing_cuda();
}
std::shared_ptr<std::byte[]> alloc_pinned(context&, std::size_t) {
  missing_cuda();
}

}  // namespace moevement::models::cuda
