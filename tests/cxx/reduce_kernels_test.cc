// The reduction kernels (xla_ext/reduce_kernels.h): ReduceInto on random bit patterns (NaN and
// inf included), odd lengths, misaligned buffers, 1..8 sources and 1..3 destinations, float32,
// float64 and int32 against a scalar rank-order reference bit for bit; every dtype feeds a
// digest that the harness prints, so runs under different TRAINSPEC_XLA_EXT_ISA variants can be
// compared. Part of the harness (harness.cc).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "collective_ops.h"  // ElemBytes
#include "harness.h"
#include "reduce_kernels.h"

namespace trainspec {
namespace {

template <typename T>
T Combine(RedOp op, T a, T b) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kMean:
      if constexpr (std::is_integral<T>::value) {
        return static_cast<T>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
      } else {
        return a + b;
      }
    case RedOp::kMax: return (a > b || a != a) ? a : b;
    case RedOp::kMin: return (a < b || a != a) ? a : b;
  }
  return a;
}

// The documented semantics, one element at a time: combine sources 0..n-1 in rank order.
template <typename T>
T Reference(RedOp op, const std::vector<const T*>& srcs, size_t offset, size_t i) {
  T acc = srcs[0][offset + i];
  for (size_t s = 1; s < srcs.size(); ++s) acc = Combine(op, acc, srcs[s][offset + i]);
  if (op == RedOp::kMean) acc = acc / static_cast<T>(srcs.size());
  return acc;
}

// Replaces every NaN by one canonical NaN: which NaN's payload and sign a sum of NaNs keeps is
// left open by IEEE 754 and differs between the vector widths (docs/xla_ext.md).
void CanonicalNans(ElemType type, std::vector<uint8_t>& bytes) {
  const size_t elem = ElemBytes(type);
  for (size_t i = 0; i + elem <= bytes.size(); i += elem) {
    uint64_t v = 0;
    std::memcpy(&v, &bytes[i], elem);
    uint64_t exp_mask = 0, mant_mask = 0;
    switch (type) {
      case ElemType::kF32: exp_mask = 0x7F800000u; mant_mask = 0x7FFFFFu; break;
      case ElemType::kF64: exp_mask = 0x7FF0000000000000ull; mant_mask = 0xFFFFFFFFFFFFFull; break;
      case ElemType::kBF16: exp_mask = 0x7F80u; mant_mask = 0x7Fu; break;
      case ElemType::kF16: exp_mask = 0x7C00u; mant_mask = 0x3FFu; break;
      case ElemType::kS32: return;
    }
    if ((v & exp_mask) == exp_mask && (v & mant_mask) != 0) {
      v = exp_mask | (mant_mask & ~(mant_mask >> 1));  // positive quiet NaN
      std::memcpy(&bytes[i], &v, elem);
    }
  }
}

uint64_t Fnv(uint64_t h, const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  return h;
}

// Random bytes with a good share of special values: NaN, inf, zero, subnormal, huge.
std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t bytes, size_t elem) {
  std::vector<uint8_t> b(bytes);
  for (auto& v : b) v = static_cast<uint8_t>(rng());
  for (size_t i = 0; i + elem <= bytes; i += elem) {
    if (rng() % 8 == 0) std::memset(&b[i + elem - 1], rng() % 2 ? 0x7F : 0xFF, 1);  // exp ~max
    if (rng() % 16 == 0) std::memset(&b[i], 0, elem);
  }
  return b;
}

// Bit for bit, except that any NaN matches any NaN: IEEE 754 leaves open which operand's
// payload a sum of two NaNs keeps, and the compiler may commute the scalar reference's add.
template <typename T>
void CheckAgainstReference(Tally& t, RedOp op, const std::vector<const void*>& untyped,
                           size_t so,
                           const void* got, size_t count, const std::string& what) {
  std::vector<const T*> srcs;
  for (const void* p : untyped) srcs.push_back(static_cast<const T*>(p));
  const T* dst = static_cast<const T*>(got);
  for (size_t i = 0; i < count; ++i) {
    const T want = Reference(op, srcs, so, i);
    const bool both_nan = want != want && dst[i] != dst[i];
    if (!both_nan && std::memcmp(&want, &dst[i], sizeof(T)) != 0) {
      t.Check(false, what + " element " + std::to_string(i));
      return;
    }
  }
  t.Check(true, what);
}

}  // namespace

uint64_t TestReduceKernels(Tally& t) {
  std::mt19937_64 rng(20261130);
  uint64_t digest = 0xCBF29CE484222325ull;
  const ElemType types[] = {ElemType::kF32, ElemType::kF64, ElemType::kS32, ElemType::kBF16,
                            ElemType::kF16};
  const RedOp ops[] = {RedOp::kSum, RedOp::kMean, RedOp::kMax, RedOp::kMin};
  const size_t counts[] = {0, 1, 31, 33, 64, 257, 4099};
  for (ElemType type : types) {
    const size_t elem = ElemBytes(type);
    for (RedOp op : ops) {
      if (op == RedOp::kMean && type == ElemType::kS32) continue;
      for (size_t count : counts) {
        for (int n : {1, 3, 8}) {
          for (int m : {1, 3}) {
            for (size_t misalign : {size_t{0}, size_t{1}}) {  // elements, so unaligned bytes
              std::vector<std::vector<uint8_t>> in;
              std::vector<const void*> srcs;
              for (int s = 0; s < n; ++s) {
                in.push_back(RandomBytes(rng, (count + misalign) * elem, elem));
                srcs.push_back(in.back().data());
              }
              std::vector<std::vector<uint8_t>> out(m, std::vector<uint8_t>((count + 1) * elem));
              std::vector<void*> dsts;
              for (auto& o : out) dsts.push_back(o.data());
              ReduceInto(type, op, srcs.data(), misalign, n, dsts.data(), 1, m, count,
                         count % 2 == 1);
              const std::string what = "kernel type " + std::to_string(static_cast<int>(type)) +
                                       " op " + std::to_string(static_cast<int>(op)) +
                                       " count " + std::to_string(count) + " n " +
                                       std::to_string(n) + " m " + std::to_string(m);
              for (int d = 1; d < m; ++d) {
                t.Check(std::memcmp(out[d].data(), out[0].data(), out[0].size()) == 0,
                      what + ": destinations differ");
              }
              const void* got = out[0].data() + elem;
              if (type == ElemType::kF32) {
                CheckAgainstReference<float>(t, op, srcs, misalign, got, count, what);
              } else if (type == ElemType::kF64) {
                CheckAgainstReference<double>(t, op, srcs, misalign, got, count, what);
              } else if (type == ElemType::kS32) {
                CheckAgainstReference<int32_t>(t, op, srcs, misalign, got, count, what);
              }
              CanonicalNans(type, out[0]);
              digest = Fnv(digest, out[0].data(), out[0].size());
            }
          }
        }
      }
    }
  }
  return digest;
}

}  // namespace trainspec
