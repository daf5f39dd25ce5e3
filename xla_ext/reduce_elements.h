// The reduction's element types and combine operations, one element at a time: what the CPU
// reduction kernels (reduce_kernels.cc, vectorised through reduce_lanes.h) and the CUDA
// rank-order reduction (cuda/reduce_kernels.cu) both compute, so that the two agree bit for bit.
// Every function rounds exactly like the scalar IEEE operation it names; the translation units
// that use them are compiled without FMA contraction (-ffp-contract=off, nvcc --fmad=false).
#pragma once

#include <cstdint>
#include <type_traits>

#include "host_device.h"

namespace trainspec {
namespace lanes {

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

// float32 bits -> bfloat16 bits, nearest even; a NaN stays a NaN of its sign and payload's top
// bits, made quiet. A template so that reduce_lanes.h applies the very same operations lane-wise
// to vectors of uint32 (the conditional is element-wise there).
template <typename U>
TS_HD U RoundToBf16KeepNan(U u) {
  const U rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const U quiet_nan = (u >> 16) | 0x40u;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded;
}

// |a| by clearing the sign bit (std::fabs is not device code; the result is the same).
TS_HD float AbsBits(float a) { return BitsToFloat(FloatToBits(a) & 0x7FFFFFFFu); }

// Num<T>: how a stored element is widened to the accumulator and rounded back.
template <typename T>
struct Num {
  using Acc = T;
  static TS_HD Acc Load(T v) { return v; }
  static TS_HD T Store(Acc a) { return a; }
};

template <>
struct Num<Bf16> {
  using Acc = float;
  static TS_HD float Load(Bf16 v) { return BitsToFloat(static_cast<uint32_t>(v.bits) << 16); }
  static TS_HD Bf16 Store(float a) {
    return Bf16{static_cast<uint16_t>(RoundToBf16KeepNan(FloatToBits(a)))};
  }
};

template <>
struct Num<F16> {
  using Acc = float;
  static TS_HD float Load(F16 v) {
    const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
    const uint32_t exp = (v.bits >> 10) & 0x1Fu;
    const uint32_t mant = v.bits & 0x3FFu;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in float
      return BitsToFloat(sign | FloatToBits(static_cast<float>(mant) * 0x1.0p-24f));
    }
    if (exp == 31) return BitsToFloat(sign | 0x7F800000u | (mant << 13));
    return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  }
  // Round to nearest even via float arithmetic: scaling by 2^112 and back moves the rounding
  // point onto the f16 mantissa (overflow becomes inf), adding a power of two that is aligned
  // with the f16 exponent lets the FPU do the rounding (subnormals included).
  static TS_HD F16 Store(float a) {
    const uint32_t w = FloatToBits(a);
    const uint32_t shl1 = w + w;
    const uint32_t sign = w & 0x80000000u;
    float base = (AbsBits(a) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t bias = shl1 & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = BitsToFloat((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = FloatToBits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return F16{static_cast<uint16_t>((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign))};
  }
};

// The combine operations, on scalars (Num<T>::Acc) and, on the CPU, on GCC vectors of them
// (reduce_lanes.h). The vector forms make the same per-lane decision as the scalar ones (a NaN
// accumulator is kept; on ties, including -0.0 vs +0.0, the new operand wins).
struct AddOp {
  TS_HD float operator()(float a, float b) const { return a + b; }
  TS_HD double operator()(double a, double b) const { return a + b; }
  TS_HD int32_t operator()(int32_t a, int32_t b) const {  // wraps, like XLA
    return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
  }
#if !defined(__CUDACC__)
  template <typename V>
  TS_HD V operator()(V a, V b) const {
    if constexpr (std::is_integral<decltype(a[0] + 0)>::value) {  // wrap: add as unsigned
      using U = decltype(a > b);
      return reinterpret_cast<V>(reinterpret_cast<U>(a) + reinterpret_cast<U>(b));
    } else {
      return a + b;
    }
  }
#endif
};
struct MaxOp {
  template <typename A>
  TS_HD A operator()(A a, A b) const {
    if constexpr (std::is_arithmetic<A>::value) {
      return (a > b || a != a) ? a : b;  // a != a: keep a NaN accumulator
    } else {
      return ((a > b) | (a != a)) ? a : b;
    }
  }
};
struct MinOp {
  template <typename A>
  TS_HD A operator()(A a, A b) const {
    if constexpr (std::is_arithmetic<A>::value) {
      return (a < b || a != a) ? a : b;
    } else {
      return ((a < b) | (a != a)) ? a : b;
    }
  }
};

}  // namespace lanes
}  // namespace trainspec
