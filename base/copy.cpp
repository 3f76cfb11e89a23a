#include "base/copy.hpp"

#include <cstdint>
#include <cstring>
#include <stdexcept>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace moevement {

void copy_streaming(std::span<std::byte> to, std::span<const std::byte> from) {
  if (to.size() != from.size()) throw std::invalid_argument("copy_streaming: sizes differ");
  std::byte* d = to.data();
  const std::byte* s = from.data();
  std::size_t n = to.size();
#if defined(__SSE2__)
  constexpr std::size_t line = 64;  // four 16-byte stores: one cache line
  if (n >= 4 * line) {
    // Head: plain stores up to the first 16-byte boundary of the destination.
    const std::size_t head = (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    auto* out = reinterpret_cast<__m128i*>(d);
    const auto* in = reinterpret_cast<const __m128i*>(s);
    const std::size_t lines = n / line;
    for (std::size_t i = 0; i < lines; ++i, out += 4, in += 4) {
      const __m128i a = _mm_loadu_si128(in), b = _mm_loadu_si128(in + 1);
      const __m128i c = _mm_loadu_si128(in + 2), e = _mm_loadu_si128(in + 3);
      _mm_stream_si128(out, a);
      _mm_stream_si128(out + 1, b);
      _mm_stream_si128(out + 2, c);
      _mm_stream_si128(out + 3, e);
    }
    _mm_sfence();  // the streamed stores are ordered before any later store
    d += lines * line;
    s += lines * line;
    n -= lines * line;
  }
#endif
  std::memcpy(d, s, n);
}

}  // namespace moevement
