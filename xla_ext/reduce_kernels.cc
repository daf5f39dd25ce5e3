// Reduction and copy kernels of the xla_ext collectives (see reduce_kernels.h).
//
// One generic kernel, instantiated per ISA: the entry points below carry
// __attribute__((target(...), flatten)), so the templates inlined into them are compiled, and
// auto-vectorised, for that ISA. The kernel walks the elements in steps of 128 output bytes;
// each step loads the step's elements of every source in source order into an accumulator
// block, rounds it once and writes it to every destination. Reading all sources a little at a
// time (rather than one source block after another) keeps one hardware-prefetched stream per
// source and never re-reads an accumulator from memory, which made the all_reduce kernel about
// 3x faster than an accumulate-a-block-per-source loop (docs/xla_ext.md).
//
// Bitwise equality of the variants: each element sees exactly the same operations in the same
// order (load, then one combine per source 1..n-1, then the optional division by n, then the
// rounding); vectorising across elements does not change them, and this file is compiled with
// -ffp-contract=off so that no variant fuses a multiply and an add.
#include "reduce_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#define TRAINSPEC_X86 1
#include <immintrin.h>
#endif

#define TRAINSPEC_INLINE inline __attribute__((always_inline))

namespace trainspec {
namespace {

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

// ---- stores --------------------------------------------------------------------------------

constexpr size_t kStepBytes = 128;  // output bytes per kernel step: two cache lines
constexpr uintptr_t kLine = 64;

// Writes one step (kStepBytes from `src`, in cache) to a kLine-aligned `dst`, bypassing the
// cache. One policy per ISA; PlainLines is the fallback without non-temporal stores.
struct PlainLines {
  static TRAINSPEC_INLINE void Put(void* dst, const void* src) {
    std::memcpy(dst, src, kStepBytes);
  }
};
#if defined(TRAINSPEC_X86)
struct Sse2Lines {
  static TRAINSPEC_INLINE void Put(void* dst, const void* src) {
    auto* d = static_cast<__m128i*>(dst);
    auto* s = static_cast<const __m128i*>(src);
    for (int k = 0; k < static_cast<int>(kStepBytes / 16); ++k) {
      _mm_stream_si128(d + k, _mm_loadu_si128(s + k));
    }
  }
};
struct Avx2Lines {
  __attribute__((target("avx2"))) static inline void Put(void* dst, const void* src) {
    auto* d = static_cast<__m256i*>(dst);
    auto* s = static_cast<const __m256i*>(src);
    for (int k = 0; k < static_cast<int>(kStepBytes / 32); ++k) {
      _mm256_stream_si256(d + k, _mm256_loadu_si256(s + k));
    }
  }
};
struct Avx512Lines {
  __attribute__((target("avx512f"))) static inline void Put(void* dst,
                                                                      const void* src) {
    auto* d = static_cast<__m512i*>(dst);
    auto* s = static_cast<const __m512i*>(src);
    for (int k = 0; k < static_cast<int>(kStepBytes / 64); ++k) {
      _mm512_stream_si512(d + k, _mm512_loadu_si512(s + k));
    }
  }
};
#endif

// ---- the reduction -------------------------------------------------------------------------

template <typename T, typename Op, bool kMean, typename Lines, int kVB>
TRAINSPEC_INLINE void ReduceKernel(const T* const* srcs, size_t so, int n, T* const* dsts,
                                   size_t dof, int m, size_t count, bool stream) {
  using Acc = typename Num<T>::Acc;
  constexpr size_t kW = kStepBytes / sizeof(T);
  const Op op{};
  const Acc divisor = static_cast<Acc>(n);
  auto finish = [divisor](Acc a) {
    if (kMean) a = a / divisor;
    return Num<T>::Store(a);
  };
  auto single = [&](size_t i) {  // one element, plain stores
    Acc a = Num<T>::Load(srcs[0][so + i]);
    for (int s = 1; s < n; ++s) a = op(a, Num<T>::Load(srcs[s][so + i]));
    const T v = finish(a);
    for (int d = 0; d < m; ++d) dsts[d][dof + i] = v;
  };
  // Which elements take the vector path depends only on `count`, never on where the buffers
  // happen to lie, so an element is always computed by the same instructions.
  size_t i = 0;
  using L = Lanes<T, kVB>;
  using V = typename L::V;
  constexpr int kVecs = static_cast<int>(kW) / L::kLanes;
  for (; i + kW <= count; i += kW) {
    V acc[kVecs];
    const T* s0 = srcs[0] + so + i;
    for (int v = 0; v < kVecs; ++v) acc[v] = L::Load(s0 + v * L::kLanes);
    for (int s = 1; s < n; ++s) {
      const T* sp = srcs[s] + so + i;
      for (int v = 0; v < kVecs; ++v) acc[v] = op(acc[v], L::Load(sp + v * L::kLanes));
    }
    if (kMean) {
      for (int v = 0; v < kVecs; ++v) acc[v] = acc[v] / divisor;
    }
    alignas(64) T out[kW];
    for (int v = 0; v < kVecs; ++v) L::Store(acc[v], out + v * L::kLanes);
    for (int d = 0; d < m; ++d) {
      T* p = dsts[d] + dof + i;
      if (stream && reinterpret_cast<uintptr_t>(p) % kLine == 0) {
        Lines::Put(p, out);
      } else {
        std::memcpy(p, out, kStepBytes);
      }
    }
  }
  for (; i < count; ++i) single(i);
}

template <typename T, typename Lines, int kVB>
TRAINSPEC_INLINE void ReduceTyped(RedOp op, const void* const* srcs, size_t so, int n,
                                  void* const* dsts, size_t dof, int m, size_t count,
                                  bool stream) {
  auto* s = reinterpret_cast<const T* const*>(srcs);
  auto* d = reinterpret_cast<T* const*>(dsts);
  switch (op) {
#define TRAINSPEC_KERNEL_ARGS s, so, n, d, dof, m, count, stream
    case RedOp::kSum: ReduceKernel<T, AddOp, false, Lines, kVB>(TRAINSPEC_KERNEL_ARGS); break;
    case RedOp::kMean: ReduceKernel<T, AddOp, true, Lines, kVB>(TRAINSPEC_KERNEL_ARGS); break;
    case RedOp::kMax: ReduceKernel<T, MaxOp, false, Lines, kVB>(TRAINSPEC_KERNEL_ARGS); break;
    case RedOp::kMin: ReduceKernel<T, MinOp, false, Lines, kVB>(TRAINSPEC_KERNEL_ARGS); break;
#undef TRAINSPEC_KERNEL_ARGS
  }
}

template <typename Lines, int kVB>
TRAINSPEC_INLINE void ReduceAny(ElemType type, RedOp op, const void* const* srcs, size_t so,
                                int n, void* const* dsts, size_t dof, int m, size_t count,
                                bool stream) {
  switch (type) {
#define TRAINSPEC_TYPED_ARGS op, srcs, so, n, dsts, dof, m, count, stream
    case ElemType::kF32: ReduceTyped<float, Lines, kVB>(TRAINSPEC_TYPED_ARGS); break;
    case ElemType::kF64: ReduceTyped<double, Lines, kVB>(TRAINSPEC_TYPED_ARGS); break;
    case ElemType::kS32: ReduceTyped<int32_t, Lines, kVB>(TRAINSPEC_TYPED_ARGS); break;
    case ElemType::kBF16: ReduceTyped<Bf16, Lines, kVB>(TRAINSPEC_TYPED_ARGS); break;
    case ElemType::kF16: ReduceTyped<F16, Lines, kVB>(TRAINSPEC_TYPED_ARGS); break;
#undef TRAINSPEC_TYPED_ARGS
  }
}

// ---- the streaming copy --------------------------------------------------------------------

template <typename Lines>
TRAINSPEC_INLINE void StreamCopyWith(void* dst, const void* src, size_t bytes) {
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = static_cast<const uint8_t*>(src);
  const size_t head = std::min(bytes, static_cast<size_t>(
                                          (kLine - reinterpret_cast<uintptr_t>(d) % kLine) %
                                          kLine));
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + kStepBytes <= bytes; i += kStepBytes) Lines::Put(d + i, s + i);
  std::memcpy(d + i, s + i, bytes - i);
}

// ---- the variants --------------------------------------------------------------------------

using ReduceFn = void (*)(ElemType, RedOp, const void* const*, size_t, int, void* const*, size_t,
                          int, size_t, bool);
using CopyFn = void (*)(void*, const void*, size_t);

// The arguments of every reduction variant, as ReduceInto takes them.
#define TRAINSPEC_REDUCE_PARAMS                                                           \
  ElemType t, RedOp op, const void* const* s, size_t so, int n, void* const* d, size_t dof, \
      int m, size_t c, bool stream
#define TRAINSPEC_REDUCE_ARGS t, op, s, so, n, d, dof, m, c, stream

#if defined(TRAINSPEC_X86)
__attribute__((flatten)) void ReduceBaseline(TRAINSPEC_REDUCE_PARAMS) {
  ReduceAny<Sse2Lines, 16>(TRAINSPEC_REDUCE_ARGS);
}
__attribute__((target("avx2"), flatten)) void ReduceAvx2(TRAINSPEC_REDUCE_PARAMS) {
  ReduceAny<Avx2Lines, 32>(TRAINSPEC_REDUCE_ARGS);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), flatten)) void ReduceAvx512(
    TRAINSPEC_REDUCE_PARAMS) {
  ReduceAny<Avx512Lines, 64>(TRAINSPEC_REDUCE_ARGS);
}
__attribute__((flatten)) void CopyBaseline(void* d, const void* s, size_t b) {
  StreamCopyWith<Sse2Lines>(d, s, b);
}
__attribute__((target("avx2"), flatten)) void CopyAvx2(void* d, const void* s, size_t b) {
  StreamCopyWith<Avx2Lines>(d, s, b);
}
__attribute__((target("avx512f"), flatten)) void CopyAvx512(void* d, const void* s, size_t b) {
  StreamCopyWith<Avx512Lines>(d, s, b);
}
#else
__attribute__((flatten)) void ReduceBaseline(TRAINSPEC_REDUCE_PARAMS) {
  ReduceAny<PlainLines, 16>(TRAINSPEC_REDUCE_ARGS);
}
void CopyBaseline(void* d, const void* s, size_t b) { std::memcpy(d, s, b); }
#endif

Isa DetectIsa() {
  Isa best = Isa::kBaseline;
#if defined(TRAINSPEC_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) best = Isa::kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    best = Isa::kAvx512;
  }
#endif
  // An explicit request can only lower the level (tests compare the variants bit for bit).
  if (const char* want = std::getenv("TRAINSPEC_XLA_EXT_ISA")) {
    const std::string w(want);
    Isa asked = best;
    if (w == "baseline") asked = Isa::kBaseline;
    if (w == "avx2") asked = Isa::kAvx2;
    if (w == "avx512") asked = Isa::kAvx512;
    if (static_cast<int>(asked) < static_cast<int>(best)) best = asked;
  }
  return best;
}

struct Kernels {
  Isa isa;
  ReduceFn reduce;
  CopyFn copy;
};

const Kernels& Active() {
  static const Kernels kernels = [] {
    const Isa isa = DetectIsa();
    switch (isa) {
#if defined(TRAINSPEC_X86)
      case Isa::kAvx512: return Kernels{isa, ReduceAvx512, CopyAvx512};
      case Isa::kAvx2: return Kernels{isa, ReduceAvx2, CopyAvx2};
#endif
      default: return Kernels{Isa::kBaseline, ReduceBaseline, CopyBaseline};
    }
  }();
  return kernels;
}

}  // namespace

void ReduceInto(ElemType type, RedOp op, const void* const* srcs, size_t src_offset, int n,
                void* const* dsts, size_t dst_offset, int m, size_t count, bool stream) {
  if (count == 0 || m == 0) return;
  Active().reduce(type, op, srcs, src_offset, n, dsts, dst_offset, m, count, stream);
}

void StreamCopy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  Active().copy(dst, src, bytes);
}

void StoreFence() {
#if defined(TRAINSPEC_X86)
  _mm_sfence();
#endif
}

Isa ActiveIsa() { return Active().isa; }

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

}  // namespace trainspec
