// The packed-buffer kernels (packed_kernels.h). Written as branch-free loops over contiguous
// elements so that the compiler vectorizes them (built with -O3); vectorizing runs across
// elements and reorders nothing, and -ffp-contract=off keeps every product rounded.
#include "packed_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace trainspec {
namespace {

constexpr float kInt8Max = 127.0f;
// scale = absmax * fl(1/127): the spec defines the scale by this multiplication (what XLA makes
// of a division by the constant 127), not as a rounded quotient; then truncated to 17
// significant bits, so that q * scale (|q| <= 127: 7 bits) is exact in float32 and no FMA
// contraction, on either side, can change a sum or a residual.
constexpr float kInvInt8Max = 1.0f / 127.0f;
constexpr uint32_t kScaleMask = 0xFFFFFF80u;

// Round to nearest, ties to even; a NaN becomes the quiet NaN of its sign (as XLA converts).
inline uint16_t ToBf16Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = ((b >> 16) & 0x8000u) | 0x7FC0u;
  return static_cast<uint16_t>((b & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

inline float FromBf16Bits(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// 1.5 * 2^23: for |v| <= 127, (v + kRoundToInt) - kRoundToInt is v rounded to an integer in
// the FPU's rounding mode, round to nearest even (no libm call, which would not vectorize).
constexpr float kRoundToInt = 12582912.0f;

// One int8 block of `len` <= block elements (the rest of the block is padding): the scale
// absmax * fl(1/127) & kScaleMask (NaN if any element is NaN), and
// q = clamp(rint(x * fl(1/s)), -127, 127) with s = scale if scale > 0 else 1, a NaN product
// giving 0 -- the jnp kernel's operations (XLA turns its division by the broadcast scale into
// this multiplication). Clamping before rounding gives the same integers: the bounds are
// integers and both steps are monotonic.
float QuantizeBlock(const float* x, size_t len, size_t block, int8_t* q) {
  float absmax = 0.0f;
  int any_nan = 0;
  for (size_t i = 0; i < len; ++i) {
    const float a = std::fabs(x[i]);
    any_nan |= a != a;
    absmax = a > absmax ? a : absmax;
  }
  if (any_nan) absmax = std::numeric_limits<float>::quiet_NaN();
  float scale = absmax * kInvInt8Max;
  uint32_t bits;
  std::memcpy(&bits, &scale, 4);
  bits &= kScaleMask;
  std::memcpy(&scale, &bits, 4);
  const float inverse = 1.0f / (scale > 0.0f ? scale : 1.0f);
  for (size_t i = 0; i < len; ++i) {
    float v = x[i] * inverse;
    v = v < -kInt8Max ? -kInt8Max : v;  // a NaN passes both comparisons unchanged
    v = v > kInt8Max ? kInt8Max : v;
    const float r = v != v ? 0.0f : (v + kRoundToInt) - kRoundToInt;
    q[i] = static_cast<int8_t>(static_cast<int32_t>(r));
  }
  std::memset(q + len, 0, block - len);
  return scale;
}

void WriteHeader(const PackedFormat& f, uint8_t* packed) {
  const PackedHeader h = f.header();
  std::memcpy(packed, &h, kHeaderBytes);
}

// out[0, len) (=, or += when `add`) one stretch of dequantized values.
inline void AccumulateBf16(const uint8_t* payload, size_t len, bool add, float* out) {
  if (add) {
    for (size_t i = 0; i < len; ++i) {
      uint16_t h;
      std::memcpy(&h, payload + 2 * i, 2);
      out[i] = out[i] + FromBf16Bits(h);
    }
  } else {
    for (size_t i = 0; i < len; ++i) {
      uint16_t h;
      std::memcpy(&h, payload + 2 * i, 2);
      out[i] = FromBf16Bits(h);
    }
  }
}

inline void AccumulateInt8(const int8_t* q, float scale, size_t len, bool add, float* out) {
  if (add) {
    for (size_t i = 0; i < len; ++i) out[i] = out[i] + static_cast<float>(q[i]) * scale;
  } else {
    for (size_t i = 0; i < len; ++i) out[i] = static_cast<float>(q[i]) * scale;
  }
}

}  // namespace

void Pack(const PackedFormat& f, const float* x, uint8_t* packed, float* lost) {
  WriteHeader(f, packed);
  if (f.code == kFormatBf16) {
    uint8_t* payload = packed + kHeaderBytes;
    for (size_t i = 0; i < f.n; ++i) {
      const uint16_t h = ToBf16Bits(x[i]);
      std::memcpy(payload + 2 * i, &h, 2);
    }
    if (lost) {
      for (size_t i = 0; i < f.n; ++i) lost[i] = x[i] - FromBf16Bits(ToBf16Bits(x[i]));
    }
    if (f.n % 2) std::memset(payload + 2 * f.n, 0, 2);
    return;
  }
  int8_t* payload = reinterpret_cast<int8_t*>(packed + f.payload_offset());
  for (size_t b = 0; b < f.blocks(); ++b) {
    const size_t start = b * f.block;
    const size_t len = std::min(f.block, f.n - start);
    const float scale = QuantizeBlock(x + start, len, f.block, payload + start);
    std::memcpy(packed + f.scales_offset() + 4 * b, &scale, 4);
    if (lost) {
      const int8_t* q = payload + start;
      for (size_t i = 0; i < len; ++i) {
        lost[start + i] = x[start + i] - static_cast<float>(q[i]) * scale;
      }
    }
  }
}

void DequantizeSum(const PackedFormat& f, const uint8_t* packed, size_t k, float* out) {
  const size_t bytes = f.bytes();
  for (size_t r = 0; r < k; ++r) {
    const uint8_t* p = packed + r * bytes;
    if (f.code == kFormatBf16) {
      AccumulateBf16(p + kHeaderBytes, f.n, r > 0, out);
      continue;
    }
    const int8_t* payload = reinterpret_cast<const int8_t*>(p + f.payload_offset());
    for (size_t b = 0; b < f.blocks(); ++b) {
      float scale;
      std::memcpy(&scale, p + f.scales_offset() + 4 * b, 4);
      const size_t start = b * f.block;
      AccumulateInt8(payload + start, scale, std::min(f.block, f.n - start), r > 0, out + start);
    }
  }
}

}  // namespace trainspec
