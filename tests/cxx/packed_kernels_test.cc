// The packed-buffer kernels of collectives.compression (xla_ext/packed_kernels.h) against a
// scalar reference written from the documented arithmetic (docs/xla_ext.md), bit for bit:
// every byte of the packed buffer, the error-feedback remainder and the dequantized sums, on
// gradient-like values with exact int8 and bf16 ties, zeros, subnormals, infinities and NaN,
// lengths 0..1030 and blocks 4, 32, 256; then 8 threads packing and summing at once (the
// kernels share no state: ThreadSanitizer watches). Part of the harness (harness.cc).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "packed_kernels.h"

namespace trainspec {
namespace {

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// bfloat16 by comparing the two neighbours in double: nearer wins, a tie goes to the even one.
uint16_t ReferenceBf16(float x) {
  if (std::isnan(x)) return static_cast<uint16_t>(((Bits(x) >> 16) & 0x8000u) | 0x7FC0u);
  const uint32_t down = Bits(x) >> 16;
  if ((Bits(x) & 0xFFFFu) == 0) return static_cast<uint16_t>(down);
  const double below = FromBits(down << 16), above = FromBits((down + 1) << 16);
  const double dx = std::fabs(static_cast<double>(x) - below);
  const double ux = std::fabs(above - static_cast<double>(x));
  const bool up = ux < dx || (ux == dx && (down & 1u));
  return static_cast<uint16_t>(up ? down + 1 : down);
}

// The packed buffer, one element at a time, as docs/xla_ext.md states the arithmetic.
std::vector<uint8_t> ReferencePack(const PackedFormat& f, const std::vector<float>& x) {
  std::vector<uint8_t> out(f.bytes(), 0);
  const PackedHeader h = f.header();
  std::memcpy(out.data(), &h, sizeof h);
  if (f.code == kFormatBf16) {
    for (size_t i = 0; i < f.n; ++i) {
      const uint16_t v = ReferenceBf16(x[i]);
      std::memcpy(&out[kHeaderBytes + 2 * i], &v, 2);
    }
    return out;
  }
  for (size_t b = 0; b < f.blocks(); ++b) {
    float absmax = 0.0f;
    for (size_t i = b * f.block; i < std::min(f.n, (b + 1) * f.block); ++i) {
      if (std::isnan(x[i])) {
        absmax = std::numeric_limits<float>::quiet_NaN();
        break;
      }
      absmax = std::fmax(absmax, std::fabs(x[i]));
    }
    const float scale = FromBits(Bits(absmax * (1.0f / 127.0f)) & 0xFFFFFF80u);
    std::memcpy(&out[kHeaderBytes + 4 * b], &scale, 4);
    const float inverse = 1.0f / (scale > 0.0f ? scale : 1.0f);
    for (size_t i = b * f.block; i < std::min(f.n, (b + 1) * f.block); ++i) {
      const float r = std::nearbyint(x[i] * inverse);
      const float clamped = std::fmin(std::fmax(r, -127.0f), 127.0f);
      const int8_t q = std::isnan(r) ? 0 : static_cast<int8_t>(clamped);
      out[f.payload_offset() + i] = static_cast<uint8_t>(q);
    }
  }
  return out;
}

float ReferenceValue(const PackedFormat& f, const uint8_t* p, size_t i) {
  if (f.code == kFormatBf16) {
    uint16_t h;
    std::memcpy(&h, p + kHeaderBytes + 2 * i, 2);
    return FromBits(static_cast<uint32_t>(h) << 16);
  }
  float scale;
  std::memcpy(&scale, p + kHeaderBytes + 4 * (i / f.block), 4);
  return static_cast<float>(static_cast<int8_t>(p[f.payload_offset() + i])) * scale;
}

bool SameBits(float a, float b) { return (std::isnan(a) && std::isnan(b)) || Bits(a) == Bits(b); }

// Gradient-like values over many decades with the cases a kernel gets wrong mixed in.
std::vector<float> Values(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> exponent(-12.0f, 12.0f);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    x[i] = normal(rng) * std::exp2(exponent(rng));
    switch (rng() % 64) {
      case 0: x[i] = 0.0f; break;
      case 1: x[i] = 1e-40f; break;                                   // subnormal
      case 2: x[i] = 1.0f + 1.0f / 256; break;                        // a bf16 tie
      case 3: x[i] = static_cast<float>(rng() % 255) - 127.5f; break;  // int8 ties near 127
      case 4: if (rng() % 8 == 0) x[i] = std::numeric_limits<float>::infinity(); break;
      case 5: if (rng() % 8 == 0) x[i] = std::numeric_limits<float>::quiet_NaN(); break;
    }
  }
  return x;
}

void CheckOneFormat(const PackedFormat& f, std::mt19937& rng, Tally& t) {
  const std::string what = "packed code " + std::to_string(f.code) + " block " +
                           std::to_string(f.block) + " n " + std::to_string(f.n);
  const size_t k = 3;
  std::vector<uint8_t> packed(k * f.bytes());
  std::vector<float> sum_want(f.n);
  for (size_t r = 0; r < k; ++r) {
    const std::vector<float> x = Values(f.n, rng);
    std::vector<float> lost = x;  // aliased with the input, as the error-feedback handler does
    uint8_t* p = packed.data() + r * f.bytes();
    Pack(f, lost.data(), p, lost.data());
    const std::vector<uint8_t> want = ReferencePack(f, x);
    t.Check(std::memcmp(p, want.data(), want.size()) == 0, what + ": packed bytes");
    bool exact = true;
    for (size_t i = 0; i < f.n; ++i) {
      const float v = ReferenceValue(f, want.data(), i);
      exact &= SameBits(lost[i], x[i] - v);
      sum_want[i] = r == 0 ? v : sum_want[i] + v;
    }
    t.Check(exact, what + ": the remainder is x - dequantized");
  }
  std::vector<float> sum(f.n);
  DequantizeSum(f, packed.data(), k, sum.data());
  bool same = true;
  for (size_t i = 0; i < f.n; ++i) same &= SameBits(sum[i], sum_want[i]);
  t.Check(same, what + ": dequantized sum in buffer order");
}

// 8 threads each pack their own values, then all sum the 8 buffers: equal sums, no race.
void CheckThreads(Tally& t) {
  const PackedFormat f{kFormatInt8, 32, 4099};
  std::vector<std::vector<float>> inputs;
  std::mt19937 rng(7);
  for (int r = 0; r < 8; ++r) inputs.push_back(Values(f.n, rng));
  std::vector<uint8_t> packed(8 * f.bytes());
  std::vector<std::vector<float>> sums(8, std::vector<float>(f.n));
  std::vector<std::thread> threads;
  for (int r = 0; r < 8; ++r) {
    threads.emplace_back(
        [&, r] { Pack(f, inputs[r].data(), packed.data() + r * f.bytes(), nullptr); });
  }
  for (auto& th : threads) th.join();
  threads.clear();
  for (int r = 0; r < 8; ++r) {
    threads.emplace_back([&, r] { DequantizeSum(f, packed.data(), 8, sums[r].data()); });
  }
  for (auto& th : threads) th.join();
  bool same = true;
  for (int r = 1; r < 8; ++r) same &= std::memcmp(sums[r].data(), sums[0].data(), 4 * f.n) == 0;
  t.Check(same, "8 threads: every member's sum is the same");
}

}  // namespace

void TestPackedKernels(Tally& t) {
  std::mt19937 rng(2026);
  for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{255}, size_t{256}, size_t{1030}}) {
    CheckOneFormat(PackedFormat{kFormatBf16, 0, n}, rng, t);
    for (size_t block : {size_t{4}, size_t{32}, size_t{256}}) {
      CheckOneFormat(PackedFormat{kFormatInt8, block, n}, rng, t);
    }
  }
  CheckThreads(t);
}

}  // namespace trainspec
