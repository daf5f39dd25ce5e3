// TS_HD marks the element functions that are written once for the CPU kernels (compiled by the
// host compiler) and the CUDA kernels (compiled by nvcc): __host__ __device__ under nvcc, a plain
// forced inline otherwise. Only what both sides can run belongs behind it: no std:: calls that
// device code lacks, no vector extensions, no intrinsics of one side.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TS_HD __host__ __device__ __forceinline__
#else
#define TS_HD inline __attribute__((always_inline))
#endif

namespace trainspec {

TS_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

TS_HD uint32_t FloatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

}  // namespace trainspec
