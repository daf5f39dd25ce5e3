// The per-shard fingerprint: a bit-exact, order-independent checksum of a buffer's bytes, written
// once for the CPU handler (fingerprint.cc) and the CUDA one (cuda/fingerprint.cu).
//
// The buffer is read as little-endian 64-bit words (the tail zero-padded). Each word is mixed
// with its index and the mixed values are summed modulo 2^64: the sum is commutative, so the
// words can be visited in any order or split across threads and the result stays the same,
// while the index mixing still makes the checksum sensitive to *where* a bit flipped. The byte
// length is folded in last, so buffers that differ only by trailing zero bytes differ.
// trainspec/jax/fingerprint.py holds the NumPy reference that the tests compare against.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "host_device.h"

namespace trainspec {
namespace fingerprint {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

TS_HD uint64_t Mix64(uint64_t z) {  // splitmix64's finaliser: a bijection with full avalanche.
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Word i's term of the sum (words counted from 0).
TS_HD uint64_t WordTerm(uint64_t word, uint64_t i) { return Mix64(word ^ ((i + 1) * kGolden)); }

// The little-endian word i of `data` (nbytes long), zero-padded past the end. A full word is
// one 8-byte load (memcpy on the host: unaligned-safe; on the device `data` must then be 8-byte
// aligned, which the CUDA handler checks before taking this path); the tail is read byte by byte.
TS_HD uint64_t WordAt(const uint8_t* data, size_t nbytes, size_t i) {
  const size_t start = 8 * i;
  uint64_t word = 0;
  if (start + 8 <= nbytes) {
#if defined(__CUDA_ARCH__)
    word = *reinterpret_cast<const uint64_t*>(data + start);
#else
    std::memcpy(&word, data + start, 8);  // x86 and arm64 are little-endian
#endif
    return word;
  }
  for (size_t b = 0; start + b < nbytes; ++b) {
    word |= static_cast<uint64_t>(data[start + b]) << (8 * b);
  }
  return word;
}

TS_HD size_t Words(size_t nbytes) { return (nbytes + 7) / 8; }

// The fingerprint from the sum of every word's term.
TS_HD uint64_t Finish(uint64_t sum, size_t nbytes) {
  return Mix64(sum ^ Mix64(static_cast<uint64_t>(nbytes) + kGolden));
}

}  // namespace fingerprint
}  // namespace trainspec
