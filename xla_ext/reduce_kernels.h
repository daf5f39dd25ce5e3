// Memory kernels of the xla_ext collectives: the rank-order reduction and the streaming copy,
// each compiled for baseline x86-64 and, where the CPU has them, AVX2 and AVX-512, chosen once
// at run time (the shipped build uses no -march flag, so it runs on any x86-64).
//
// Every variant computes the same thing the same way: for each element, one combine per
// source in source order 0, 1, ..., n-1 (no reassociation, no FMA: the file is compiled with
// -ffp-contract=off), so all variants give bitwise identical results; only the vector width
// and the kind of store differ.
#pragma once

#include <cstddef>
#include <cstdint>

namespace trainspec {

enum class ElemType { kF32, kF64, kS32, kBF16, kF16 };
enum class RedOp { kSum, kMean, kMax, kMin };
enum class Isa { kBaseline, kAvx2, kAvx512 };

// For every i < count and every d < m, with offsets and i counted in elements:
//   dsts[d][dst_offset + i] =
//       srcs[0][src_offset + i] (op) srcs[1][src_offset + i] (op) ... (op) srcs[n-1][...],
// combined left to right in that order; mean is that sum divided by n. (Offsets rather than shifted
// pointer arrays, so that callers pass the members' base pointers as they are.) bfloat16/float16
// are accumulated in float32 and rounded once (nearest even); int32 sums wrap. max/min propagate
// NaN. `stream`: write with non-temporal stores (the caller issues StoreFence() before anyone else
// reads the destinations).
void ReduceInto(ElemType type, RedOp op, const void* const* srcs, size_t src_offset, int n,
                void* const* dsts, size_t dst_offset, int m, size_t count, bool stream);

// memcpy that bypasses the cache on the destination side (non-temporal stores where aligned).
void StreamCopy(void* dst, const void* src, size_t bytes);

// Orders earlier non-temporal stores before later stores (a no-op off x86).
void StoreFence();

// The variant in use: the best the CPU supports, unless the environment variable
// TRAINSPEC_XLA_EXT_ISA (baseline, avx2, avx512) asks for a lower one; read once.
Isa ActiveIsa();
const char* IsaName(Isa isa);

}  // namespace trainspec
