// Per-shard fingerprint: a bit-exact, order-independent checksum of a buffer's bytes.
//
// The buffer is read as little-endian 64-bit words (the tail zero-padded). Each word is mixed
// with its index and the mixed values are summed modulo 2^64: the sum is commutative, so the
// words can be visited in any order or split across threads and the result stays the same,
// while the index mixing still makes the checksum sensitive to *where* a bit flipped. The byte
// length is folded in last, so buffers that differ only by trailing zero bytes differ.
// trainspec/jax/fingerprint.py holds the NumPy reference that the tests compare against.
#include <cstdint>
#include <cstring>

#include "handlers.h"

namespace ffi = xla::ffi;

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t Mix64(uint64_t z) {  // splitmix64's finaliser: a bijection with full avalanche.
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t Fingerprint(const uint8_t* data, size_t nbytes) {
  uint64_t sum = 0;
  const size_t full_words = nbytes / 8;
  for (size_t i = 0; i < full_words; ++i) {
    uint64_t word;
    std::memcpy(&word, data + 8 * i, 8);  // unaligned-safe; x86 and arm64 are little-endian
    sum += Mix64(word ^ ((i + 1) * kGolden));
  }
  if (size_t tail = nbytes % 8) {
    uint64_t word = 0;
    std::memcpy(&word, data + 8 * full_words, tail);
    sum += Mix64(word ^ ((full_words + 1) * kGolden));
  }
  return Mix64(sum ^ Mix64(static_cast<uint64_t>(nbytes) + kGolden));
}

ffi::Error FingerprintImpl(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::U32>> out) {
  if (out->element_count() != 2) {
    return ffi::Error::InvalidArgument("trainspec_fingerprint: output must hold 2 uint32 words");
  }
  if (x.element_count() > 0 && x.untyped_data() == nullptr) {
    return ffi::Error::InvalidArgument("trainspec_fingerprint: input buffer has no data");
  }
  const uint64_t h = Fingerprint(static_cast<const uint8_t*>(x.untyped_data()), x.size_bytes());
  out->typed_data()[0] = static_cast<uint32_t>(h);
  out->typed_data()[1] = static_cast<uint32_t>(h >> 32);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecFingerprint, FingerprintImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::U32>>());
