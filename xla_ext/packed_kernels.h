// The packed-buffer kernels of collectives.compression on plain host memory (no XLA): packing
// (quantize, optionally keeping what was lost: error feedback) and dequantize-and-sum. The format
// and the element operations are packed_format.h's, shared with the CUDA kernels. The FFI
// handlers (compression.cc) validate their operands and call these; tests/cxx/harness.cc checks
// them against a scalar reference.
#pragma once

#include <cstddef>
#include <cstdint>

#include "packed_format.h"

namespace trainspec {

// Packs x (f.n elements) into `packed` (f.bytes()); with `lost` non-null also stores
// x - dequantized(x) there (x may alias `lost`: each element is read before it is overwritten).
void Pack(const PackedFormat& f, const float* x, uint8_t* packed, float* lost);

// out = the sum over the k packed buffers (consecutive, f.bytes() each) of their dequantized
// values, in buffer order. The headers are the caller's to check.
void DequantizeSum(const PackedFormat& f, const uint8_t* packed, size_t k, float* out);

}  // namespace trainspec
