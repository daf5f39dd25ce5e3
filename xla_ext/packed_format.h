// The packed buffers of collectives.compression: the format and the per-element and per-block
// operations of packing (quantize, bf16 rounding) and unpacking, written once for the CPU kernels
// (packed_kernels.cc) and the CUDA kernels (cuda/packed_kernels.cu), which only differ in how
// they walk the elements. NumPy definition: trainspec/core/packed.py.
//
// Packed layout (docs/xla_ext.md), little-endian, every field at a multiple of 4 bytes from the
// start:
//   header  16 bytes: uint32 magic "TSQ1", uint32 format (1 bf16, 2 int8), uint32 elements n,
//           uint32 block (int8: elements per scale; bf16: 0)
//   int8:   float32 scale[blocks], then int8 payload[blocks * block] (last block zero-padded)
//   bf16:   uint16 payload[n], then one zero uint16 if n is odd
// The arithmetic is float32 in the order of the jnp kernels (trainspec/jax/collectives/
// compression.py); both kernel files are compiled without FMA contraction, so all three agree
// bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "host_device.h"

namespace trainspec {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the packed layout is little-endian");

constexpr uint32_t kPackedMagic = 0x31515354;  // the bytes "TSQ1"
constexpr uint32_t kFormatBf16 = 1;
constexpr uint32_t kFormatInt8 = 2;
constexpr size_t kHeaderBytes = 16;

struct PackedHeader {
  uint32_t magic, format, elements, block;
};

// What a packed buffer of n elements looks like.
struct PackedFormat {
  uint32_t code = 0;
  size_t block = 0;  // 0 for bf16
  size_t n = 0;

  TS_HD size_t blocks() const { return code == kFormatInt8 ? (n + block - 1) / block : 0; }
  TS_HD size_t scales_offset() const { return kHeaderBytes; }
  TS_HD size_t payload_offset() const { return kHeaderBytes + 4 * blocks(); }
  TS_HD size_t bytes() const {
    return code == kFormatInt8 ? payload_offset() + blocks() * block
                               : kHeaderBytes + 2 * (n + n % 2);
  }
  TS_HD PackedHeader header() const {
    return PackedHeader{kPackedMagic, code, static_cast<uint32_t>(n),
                        static_cast<uint32_t>(block)};
  }
};

namespace packed {

constexpr float kInt8Max = 127.0f;
// scale = absmax * fl(1/127): the spec defines the scale by this multiplication (what XLA makes
// of a division by the constant 127), not as a rounded quotient; then truncated to 17
// significant bits, so that q * scale (|q| <= 127: 7 bits) is exact in float32 and no FMA
// contraction, on either side, can change a sum or a residual.
constexpr float kInvInt8Max = 1.0f / 127.0f;
constexpr uint32_t kScaleMask = 0xFFFFFF80u;
// 1.5 * 2^23: for |v| <= 127, (v + kRoundToInt) - kRoundToInt is v rounded to an integer in
// the FPU's rounding mode, round to nearest even (no libm call, which would not vectorize).
constexpr float kRoundToInt = 12582912.0f;

// float32 -> bfloat16 bits, nearest even; a NaN becomes the quiet NaN of its sign (as XLA
// converts).
TS_HD uint16_t ToBf16Bits(float f) {
  const uint32_t b = FloatToBits(f);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = ((b >> 16) & 0x8000u) | 0x7FC0u;
  return static_cast<uint16_t>((b & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

TS_HD float FromBf16Bits(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// |x| and whether x is NaN, the two things a block's absmax is made of. The max over a block
// is order-free, so any walk (a loop, a tree of CUDA threads) gives the same absmax.
TS_HD float AbsOf(float x) { return BitsToFloat(FloatToBits(x) & 0x7FFFFFFFu); }
TS_HD float MaxOf(float a, float b) { return a > b ? a : b; }

// The block's scale from its absmax (NaN when any element was NaN: `any_nan`).
TS_HD float BlockScale(float absmax, bool any_nan) {
  const float scale = (any_nan ? BitsToFloat(0x7FC00000u) : absmax) * kInvInt8Max;
  return BitsToFloat(FloatToBits(scale) & kScaleMask);
}

// What the elements of a block are multiplied by: fl(1/s) with s = scale if scale > 0 else 1
// (XLA turns the jnp kernel's division by the broadcast scale into this multiplication).
TS_HD float BlockInverse(float scale) { return 1.0f / (scale > 0.0f ? scale : 1.0f); }

// q = clamp(rint(x * inverse), -127, 127), a NaN product giving 0. Clamping before rounding
// gives the same integers: the bounds are integers and both steps are monotonic.
TS_HD int8_t QuantizeElement(float x, float inverse) {
  float v = x * inverse;
  v = v < -kInt8Max ? -kInt8Max : v;  // a NaN passes both comparisons unchanged
  v = v > kInt8Max ? kInt8Max : v;
  const float r = v != v ? 0.0f : (v + kRoundToInt) - kRoundToInt;
  return static_cast<int8_t>(static_cast<int32_t>(r));
}

TS_HD float DequantizeElement(int8_t q, float scale) { return static_cast<float>(q) * scale; }

}  // namespace packed
}  // namespace trainspec
