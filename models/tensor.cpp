#include "models/tensor.hpp"

#include <cmath>
#include <cstring>
#include <stdexcept>

namespace moevement::models {

std::size_t dtype_size(dtype t) {
  return t == dtype::f32 ? 4 : 2;
}

std::string_view dtype_name(dtype t) {
  switch (t) {
    case dtype::f32:
      return "f32";
    case dtype::f16:
      return "f16";
    case dtype::bf16:
      return "bf16";
  }
  return "?";
}

dtype parse_dtype(std::string_view name) {
  if (name == "f32" || name == "fp32") return dtype::f32;
  if (name == "f16" || name == "fp16") return dtype::f16;
  if (name == "bf16") return dtype::bf16;
  throw std::invalid_argument("unknown dtype '" + std::string(name) +
                              "' (use one of: f32, f16, bf16)");
}

std::string_view device_name(device d) {
  return d == device::cpu ? "cpu" : "cuda";
}

std::uint16_t f32_to_f16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // inf or NaN (keep NaN quiet)
    return static_cast<std::uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  }
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (ax < 0x38800000u) {
    // Below 2^-14: an f16 subnormal (units of 2^-24). Scaling by 2^24 is exact, and
    // nearbyint rounds to nearest even in the default rounding mode; 1024 encodes 2^-14.
    const float scaled = std::bit_cast<float>(ax) * 16777216.0f;
    return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(std::nearbyint(scaled)));
  }
  const std::uint32_t mant = ax & 0x7fffffu;
  const std::uint32_t exp = (ax >> 23) - 127 + 15;
  std::uint32_t h = (exp << 10) | (mant >> 13);
  const std::uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return static_cast<std::uint16_t>(sign | h);
}

float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;  // 2^-24, exact
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

void convert_from_f32(dtype to, std::span<const float> src, std::span<std::byte> dst) {
  if (dst.size() != src.size() * dtype_size(to)) {
    throw std::invalid_argument("convert_from_f32: destination size does not match");
  }
  if (to == dtype::f32) {
    std::memcpy(dst.data(), src.data(), dst.size());
    return;
  }
  auto* out = reinterpret_cast<std::uint16_t*>(dst.data());
  if (to == dtype::f16) {
    for (std::size_t i = 0; i < src.size(); ++i) out[i] = f32_to_f16(src[i]);
  } else {
    for (std::size_t i = 0; i < src.size(); ++i) out[i] = f32_to_bf16(src[i]);
  }
}

void convert_to_f32(dtype from, std::span<const std::byte> src, std::span<float> dst) {
  if (src.size() != dst.size() * dtype_size(from)) {
    throw std::invalid_argument("convert_to_f32: source size does not match");
  }
  if (from == dtype::f32) {
    std::memcpy(dst.data(), src.data(), src.size());
    return;
  }
  const auto* in = reinterpret_cast<const std::uint16_t*>(src.data());
  if (from == dtype::f16) {
    for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = f16_to_f32(in[i]);
  } else {
    for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = bf16_to_f32(in[i]);
  }
}

tensor::tensor(std::vector<std::int64_t> shape, dtype type, device where)
    : shape_(std::move(shape)), type_(type), where_(where) {
  if (where_ != device::cpu) {
    throw std::invalid_argument(
        "tensor: device memory is managed by the CUDA backend (models/cuda); create a cpu tensor "
        "and copy it there");
  }
  numel_ = 1;
  for (const auto d : shape_) {
    if (d < 0) throw std::invalid_argument("tensor: negative dimension");
    numel_ *= d;
  }
  bytes_.assign(static_cast<std::size_t>(numel_) * dtype_size(type_), std::byte{0});
}

void tensor::check_type(bool want_float) const {
  if (want_float != (type_ == dtype::f32)) {
    throw std::logic_error(std::string("tensor: viewing a ") + std::string(dtype_name(type_)) +
                           " tensor with the wrong element type");
  }
}

tensor tensor::to(dtype type) const {
  tensor out(shape_, type, where_);
  std::vector<float> tmp(static_cast<std::size_t>(numel_));
  convert_to_f32(type_, bytes_, tmp);
  convert_from_f32(type, tmp, out.bytes_);
  return out;
}

}  // namespace moevement::models
