// The CUDA kernels of xla_ext, as host functions that enqueue them on a stream (the .cu files).
// Each computes, element for element, what its CPU counterpart computes (packed_kernels.h,
// reduce_kernels.h, fingerprint_words.h), from the same TS_HD element functions and without FMA
// contraction (nvcc --fmad=false), so results agree bit for bit. Pointers are device pointers;
// nothing here checks operands (the handlers do) or synchronises.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "packed_format.h"
#include "reduce_kernels.h"

namespace trainspec {
namespace cuda {

// Packs x (+ residual, when non-null) into `packed` (f.bytes()); with `lost` non-null also stores
// what packing lost there. `lost` may alias `residual` (each element is read before it is
// written), not x.
cudaError_t LaunchPack(const PackedFormat& f, const float* x, const float* residual,
                       uint8_t* packed, float* lost, cudaStream_t stream);

// out = the sum over k packed buffers (consecutive, f.bytes() each) of their dequantized values,
// in buffer order.
cudaError_t LaunchDequantizeSum(const PackedFormat& f, const uint8_t* packed, size_t k,
                                float* out, cudaStream_t stream);

// out[i] = rows[0][i] (op) rows[1][i] (op) ... (op) rows[n-1][i], left to right (mean: that sum
// divided by n), for the n consecutive rows of `count` elements of `rows`: ReduceInto's order.
cudaError_t LaunchReduceRows(ElemType type, RedOp op, const void* rows, int n, size_t count,
                             void* out, cudaStream_t stream);

// The fingerprint of nbytes at `data` (8-byte aligned) into out[0] (low word), out[1] (high).
cudaError_t LaunchFingerprint(const uint8_t* data, size_t nbytes, uint32_t* out,
                              cudaStream_t stream);

}  // namespace cuda
}  // namespace trainspec
