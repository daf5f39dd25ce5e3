// The packed buffers of collectives.compression on plain memory (no XLA): the format, packing
// (quantize, optionally keeping what was lost: error feedback) and dequantize-and-sum. The FFI
// handlers (compression.cc) validate their operands and call these; tests/cxx/harness.cc checks
// them against a scalar reference.
//
// Packed layout (docs/xla_ext.md; NumPy definition trainspec/core/packed.py), little-endian,
// every field at a multiple of 4 bytes from the start:
//   header  16 bytes: uint32 magic "TSQ1", uint32 format (1 bf16, 2 int8), uint32 elements n,
//           uint32 block (int8: elements per scale; bf16: 0)
//   int8:   float32 scale[blocks], then int8 payload[blocks * block] (last block zero-padded)
//   bf16:   uint16 payload[n], then one zero uint16 if n is odd
// The arithmetic is float32 in the order of the jnp kernels (trainspec/jax/collectives/compression.py)
// and packed_kernels.cc is compiled without FMA contraction, so the two agree bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

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

  size_t blocks() const { return code == kFormatInt8 ? (n + block - 1) / block : 0; }
  size_t scales_offset() const { return kHeaderBytes; }
  size_t payload_offset() const { return kHeaderBytes + 4 * blocks(); }
  size_t bytes() const {
    return code == kFormatInt8 ? payload_offset() + blocks() * block
                               : kHeaderBytes + 2 * (n + n % 2);
  }
  PackedHeader header() const {
    return PackedHeader{kPackedMagic, code, static_cast<uint32_t>(n),
                        static_cast<uint32_t>(block)};
  }
};

// Packs x (f.n elements) into `packed` (f.bytes()); with `lost` non-null also stores
// x - dequantized(x) there (x may alias `lost`: each element is read before it is overwritten).
void Pack(const PackedFormat& f, const float* x, uint8_t* packed, float* lost);

// out = the sum over the k packed buffers (consecutive, f.bytes() each) of their dequantized
// values, in buffer order. The headers are the caller's to check.
void DequantizeSum(const PackedFormat& f, const uint8_t* packed, size_t k, float* out);

}  // namespace trainspec
