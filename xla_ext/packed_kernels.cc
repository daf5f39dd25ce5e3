// The packed-buffer kernels on the CPU (packed_kernels.h): packed_format.h's element operations
// in branch-free loops over contiguous elements, so that the compiler vectorizes them (built with
// -O3); vectorizing runs across elements and reorders nothing, and -ffp-contract=off keeps every
// product rounded.
#include "packed_kernels.h"

#include <algorithm>
#include <cstring>

namespace trainspec {
namespace {

using namespace packed;  // NOLINT: the kernels below are written in its terms

// One int8 block of `len` <= block elements (the rest of the block is padding); returns its
// scale.
float QuantizeBlock(const float* x, size_t len, size_t block, int8_t* q) {
  float absmax = 0.0f;
  int any_nan = 0;
  for (size_t i = 0; i < len; ++i) {
    const float a = AbsOf(x[i]);
    any_nan |= a != a;
    absmax = MaxOf(a, absmax);
  }
  const float scale = BlockScale(absmax, any_nan != 0);
  const float inverse = BlockInverse(scale);
  for (size_t i = 0; i < len; ++i) q[i] = QuantizeElement(x[i], inverse);
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
    for (size_t i = 0; i < len; ++i) out[i] = out[i] + DequantizeElement(q[i], scale);
  } else {
    for (size_t i = 0; i < len; ++i) out[i] = DequantizeElement(q[i], scale);
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
        lost[start + i] = x[start + i] - DequantizeElement(q[i], scale);
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
