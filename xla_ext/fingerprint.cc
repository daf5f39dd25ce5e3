// The per-shard fingerprint (fingerprint_words.h) as an XLA FFI handler on the CPU.
#include <cstdint>

#include "fingerprint_words.h"
#include "handler_checks.h"
#include "handlers.h"

namespace ffi = xla::ffi;

namespace {

uint64_t Fingerprint(const uint8_t* data, size_t nbytes) {
  using namespace trainspec::fingerprint;  // NOLINT: the checksum is written in its terms
  uint64_t sum = 0;
  for (size_t i = 0; i < Words(nbytes); ++i) sum += WordTerm(WordAt(data, nbytes, i), i);
  return Finish(sum, nbytes);
}

ffi::Error FingerprintImpl(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::U32>> out) {
  if (ffi::Error e = trainspec::CheckFingerprint(x, *out); e.failure()) return e;
  const uint64_t h = Fingerprint(static_cast<const uint8_t*>(x.untyped_data()), x.size_bytes());
  out->typed_data()[0] = static_cast<uint32_t>(h);
  out->typed_data()[1] = static_cast<uint32_t>(h >> 32);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecFingerprint, FingerprintImpl,
                              trainspec::BindFingerprint(ffi::Ffi::Bind()));
