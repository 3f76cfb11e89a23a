// Tensors: a shape, a dtype (fp32, fp16, bf16) and a device tag over owned bytes.
// The CPU kernels work on raw float pointers (llm.c style); tensor is the owning container
// and the unit the engine will describe on the wire. 2-byte formats are converted in software
// with round-to-nearest-even so the bits never depend on the CPU's F16C unit or its flags.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moevement::models {

enum class dtype : std::uint8_t { f32, f16, bf16 };
enum class device : std::uint8_t { cpu, cuda };

std::size_t dtype_size(dtype t);
std::string_view dtype_name(dtype t);
// "f32"/"fp32", "f16"/"fp16", "bf16"; throws std::invalid_argument naming the accepted values.
dtype parse_dtype(std::string_view name);
std::string_view device_name(device d);

// Round-to-nearest-even conversions. f16: overflow gives +-inf, NaN stays NaN.
std::uint16_t f32_to_f16(float f);
float f16_to_f32(std::uint16_t h);
inline std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float bf16_to_f32(std::uint16_t h) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

// dst[i] = round(src[i]) in `to` (f16/bf16: 2 bytes per element; f32: a copy).
void convert_from_f32(dtype to, std::span<const float> src, std::span<std::byte> dst);
// dst[i] = exact f32 value of src[i] stored in `from`.
void convert_to_f32(dtype from, std::span<const std::byte> src, std::span<float> dst);

class tensor {
 public:
  tensor() = default;
  // Zero-filled. Only device::cpu owns host bytes; a cuda tensor lives in models/cuda and is
  // refused here with an explanation.
  tensor(std::vector<std::int64_t> shape, dtype type, device where = device::cpu);

  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t numel() const { return numel_; }
  dtype type() const { return type_; }
  device where() const { return where_; }
  std::span<std::byte> bytes() { return bytes_; }
  std::span<const std::byte> bytes() const { return bytes_; }
  // Typed views; throw when the dtype does not match T (float for f32, uint16_t for f16/bf16).
  template <class T>
  std::span<T> as();
  template <class T>
  std::span<const T> as() const;

  // A new tensor with the same shape in another dtype (rounding to nearest even).
  tensor to(dtype type) const;

 private:
  void check_type(bool want_float) const;
  std::vector<std::int64_t> shape_;
  std::int64_t numel_ = 0;
  dtype type_ = dtype::f32;
  device where_ = device::cpu;
  std::vector<std::byte> bytes_;
};

template <class T>
std::span<T> tensor::as() {
  check_type(sizeof(T) == 4);
  return {reinterpret_cast<T*>(bytes_.data()), static_cast<std::size_t>(numel_)};
}
template <class T>
std::span<const T> tensor::as() const {
  check_type(sizeof(T) == 4);
  return {reinterpret_cast<const T*>(bytes_.data()), static_cast<std::size_t>(numel_)};
}

}  // namespace moevement::models
