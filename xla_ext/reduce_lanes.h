// Element types, vector lanes and combine operations of the reduction kernels: the parts of
// reduce_kernels.cc that every ISA variant instantiates alike. Included by reduce_kernels.cc
// only; everything here is inlined into the per-ISA entry points.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define TRAINSPEC_INLINE inline __attribute__((always_inline))

namespace trainspec {
namespace lanes {

// ---- element types -------------------------------------------------------------------------

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

TRAINSPEC_INLINE float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
TRAINSPEC_INLINE uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Num<T>: how a stored element is widened to the accumulator and rounded back.
template <typename T>
struct Num {
  using Acc = T;
  static TRAINSPEC_INLINE Acc Load(T v) { return v; }
  static TRAINSPEC_INLINE T Store(Acc a) { return a; }
};

template <>
struct Num<Bf16> {
  using Acc = float;
  static TRAINSPEC_INLINE float Load(Bf16 v) {
    return BitsToFloat(static_cast<uint32_t>(v.bits) << 16);
  }
  static TRAINSPEC_INLINE Bf16 Store(float a) {
    const uint32_t u = FloatToBits(a);
    const uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);  // nearest, ties to even
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return Bf16{static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan
                                                                        : rounded >> 16)};
  }
};

template <>
struct Num<F16> {
  using Acc = float;
  static TRAINSPEC_INLINE float Load(F16 v) {
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
  static TRAINSPEC_INLINE F16 Store(float a) {
    const uint32_t w = FloatToBits(a);
    const uint32_t shl1 = w + w;
    const uint32_t sign = w & 0x80000000u;
    float base = (std::fabs(a) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t bias = shl1 & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = BitsToFloat((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = FloatToBits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return F16{static_cast<uint16_t>((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign))};
  }
};

// Vectors in GCC/Clang's generic vector extension, kVB bytes wide: 16 on baseline x86-64
// (xmm), 32 under AVX2 (ymm), 64 under AVX-512 (zmm). Arithmetic on them is lane-wise IEEE
// arithmetic, exactly the scalar operation on each element.
template <int kVB>
struct Vec {
  typedef float F32 __attribute__((vector_size(kVB)));
  typedef double F64 __attribute__((vector_size(kVB)));
  typedef int32_t I32 __attribute__((vector_size(kVB)));
  typedef uint32_t U32 __attribute__((vector_size(kVB)));
  typedef uint16_t U16 __attribute__((vector_size(kVB / 2)));  // as many lanes as U32
};

template <typename V, typename T>
TRAINSPEC_INLINE V LoadVec(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename V, typename T>
TRAINSPEC_INLINE void StoreVec(V v, T* p) {
  std::memcpy(p, &v, sizeof(v));
}

// Lanes<T, kVB>: loads kLanes stored elements into one accumulator vector and rounds one back.
template <typename T, int kVB>
struct Lanes {  // float, double, int32: the accumulator is the element type
  using V = typename std::conditional<
      std::is_same<T, float>::value, typename Vec<kVB>::F32,
      typename std::conditional<std::is_same<T, double>::value, typename Vec<kVB>::F64,
                                typename Vec<kVB>::I32>::type>::type;
  static constexpr int kLanes = kVB / static_cast<int>(sizeof(T));
  static TRAINSPEC_INLINE V Load(const T* p) { return LoadVec<V>(p); }
  static TRAINSPEC_INLINE void Store(V v, T* p) { StoreVec(v, p); }
};
template <int kVB>
struct Lanes<Bf16, kVB> {  // the same bit operations as Num<Bf16>, lane by lane
  using V = typename Vec<kVB>::F32;
  using U32 = typename Vec<kVB>::U32;
  using U16 = typename Vec<kVB>::U16;
  static constexpr int kLanes = kVB / 4;
  static TRAINSPEC_INLINE V Load(const Bf16* p) {
    const U32 u = __builtin_convertvector(LoadVec<U16>(p), U32) << 16;
    return reinterpret_cast<V>(u);
  }
  static TRAINSPEC_INLINE void Store(V v, Bf16* p) {
    const U32 u = reinterpret_cast<U32>(v);
    const U32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const U32 quiet_nan = (u >> 16) | 0x40u;
    const U32 r = (u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded;
    StoreVec(__builtin_convertvector(r, U16), p);
  }
};
template <int kVB>
struct Lanes<F16, kVB> {  // element by element through Num<F16> (not a hot path)
  using V = typename Vec<kVB>::F32;
  static constexpr int kLanes = kVB / 4;
  static TRAINSPEC_INLINE V Load(const F16* p) {
    V v;
    for (int k = 0; k < kLanes; ++k) v[k] = Num<F16>::Load(p[k]);
    return v;
  }
  static TRAINSPEC_INLINE void Store(V v, F16* p) {
    for (int k = 0; k < kLanes; ++k) p[k] = Num<F16>::Store(v[k]);
  }
};

// The combine operations, on scalars (Num<T>::Acc) and on vectors of them. The vector forms
// make the same per-lane decision as the scalar ones (a NaN accumulator is kept; on ties,
// including -0.0 vs +0.0, the new operand wins).
struct AddOp {
  TRAINSPEC_INLINE float operator()(float a, float b) const { return a + b; }
  TRAINSPEC_INLINE double operator()(double a, double b) const { return a + b; }
  TRAINSPEC_INLINE int32_t operator()(int32_t a, int32_t b) const {  // wraps, like XLA
    return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
  }
  template <typename V>
  TRAINSPEC_INLINE V operator()(V a, V b) const {
    if constexpr (std::is_integral<decltype(a[0] + 0)>::value) {  // wrap: add as unsigned
      using U = decltype(a > b);
      return reinterpret_cast<V>(reinterpret_cast<U>(a) + reinterpret_cast<U>(b));
    } else {
      return a + b;
    }
  }
};
struct MaxOp {
  template <typename A>
  TRAINSPEC_INLINE A operator()(A a, A b) const {
    if constexpr (std::is_arithmetic<A>::value) {
      return (a > b || a != a) ? a : b;  // a != a: keep a NaN accumulator
    } else {
      return ((a > b) | (a != a)) ? a : b;
    }
  }
};
struct MinOp {
  template <typename A>
  TRAINSPEC_INLINE A operator()(A a, A b) const {
    if constexpr (std::is_arithmetic<A>::value) {
      return (a < b || a != a) ? a : b;
    } else {
      return ((a < b) | (a != a)) ? a : b;
    }
  }
};

}  // namespace lanes
}  // namespace trainspec
