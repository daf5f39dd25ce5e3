// Reduction and copy kernels of the xla_ext collectives (see reduce_kernels.h).
//
// One generic kernel (element types and lanes in reduce_lanes.h), instantiated per ISA: the entry
// points below carry __attribute__((target(...), flatten)), so the templates inlined into them are
// compiled, and auto-vectorised, for that ISA. The kernel walks the elements in steps of 128 output
// bytes; each step loads the step's elements of every source in source order into an accumulator
// block, rounds it once and writes it to every destination. Reading all sources a little at a time
// (rather than one source block after another) keeps one hardware-prefetched stream per source and
// never re-reads an accumulator from memory, which made the all_reduce kernel about 3x faster than
// an accumulate-a-block-per-source loop (docs/xla_ext.md).
//
// Bitwise equality of the variants: each element sees exactly the same operations in the same
// order (load, then one combine per source 1..n-1, then the optional division by n, then the
// rounding); vectorising across elements does not change them, and this file is compiled with
// -ffp-contract=off so that no variant fuses a multiply and an add.
#include "reduce_kernels.h"

#include "reduce_lanes.h"

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

namespace trainspec {
namespace {

using namespace lanes;  // NOLINT: the kernels below are written in its terms

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
