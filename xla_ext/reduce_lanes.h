// Vector lanes of the CPU reduction kernels: the parts of reduce_kernels.cc that every ISA
// variant instantiates alike. The element types, their conversions and the combine operations
// are reduce_elements.h's (shared with the CUDA kernels); this file applies the same operations
// to GCC vectors. Included by reduce_kernels.cc only; everything here is inlined into the
// per-ISA entry points.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "reduce_elements.h"

#define TRAINSPEC_INLINE inline __attribute__((always_inline))

namespace trainspec {
namespace lanes {

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
    const U32 r = RoundToBf16KeepNan(reinterpret_cast<U32>(v));
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

}  // namespace lanes
}  // namespace trainspec
