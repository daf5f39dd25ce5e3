// The fingerprint and packed-buffer handlers on CUDA: thin wrappers that check the operands with
// the CPU handlers' checks (handler_checks.h) and enqueue the kernels (device_kernels.h) on the
// stream XLA runs the custom call on. A launch failure is an INTERNAL error naming the op; no
// handler crashes on a bad call.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cuda_handlers.h"
#include "device_kernels.h"
#include "handler_checks.h"

namespace ffi = xla::ffi;

namespace {

using trainspec::PackedFormat;
using Stream = ffi::PlatformStream<cudaStream_t>;

ffi::Error Launched(const char* op, cudaError_t e) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("trainspec_") + op + " (CUDA): " +
                              cudaGetErrorString(e));
}

ffi::Error FingerprintImpl(cudaStream_t stream, ffi::AnyBuffer x,
                           ffi::Result<ffi::Buffer<ffi::U32>> out) {
  if (ffi::Error e = trainspec::CheckFingerprint(x, *out); e.failure()) return e;
  if (reinterpret_cast<uintptr_t>(x.untyped_data()) % 8 != 0 ||
      reinterpret_cast<uintptr_t>(out->typed_data()) % 8 != 0) {
    return ffi::Error::InvalidArgument("trainspec_fingerprint (CUDA): buffers must be 8-byte "
                                       "aligned (XLA's are)");
  }
  return Launched("fingerprint",
                  trainspec::cuda::LaunchFingerprint(
                      static_cast<const uint8_t*>(x.untyped_data()), x.size_bytes(),
                      out->typed_data(), stream));
}

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> packed,
                        std::string_view compression, int64_t block) {
  PackedFormat f;
  if (ffi::Error e = trainspec::CheckQuantize(compression, block, x, *packed, &f); e.failure()) {
    return e;
  }
  return Launched("quantize", trainspec::cuda::LaunchPack(
                                  f, static_cast<const float*>(x.untyped_data()), nullptr,
                                  static_cast<uint8_t*>(packed->untyped_data()), nullptr, stream));
}

// The headers are checked like the CPU handler checks them, from a host copy: that copy waits
// for the stream (what precedes the dequantize must have run), the price of refusing a bad buffer
// with a clear error rather than summing garbage.
ffi::Error DequantizeImpl(cudaStream_t stream, ffi::AnyBuffer packed,
                          ffi::Result<ffi::AnyBuffer> out, std::string_view compression,
                          int64_t block) {
  constexpr const char* kOp = "dequantize";
  PackedFormat f;
  size_t count = 0;
  if (ffi::Error e = trainspec::CheckDequantize(compression, block, packed, *out, &f, &count);
      e.failure()) {
    return e;
  }
  const auto* data = static_cast<const uint8_t*>(packed.untyped_data());
  std::vector<uint8_t> headers(trainspec::kHeaderBytes * count);
  cudaError_t copied = cudaMemcpy2DAsync(headers.data(), trainspec::kHeaderBytes, data, f.bytes(),
                                         trainspec::kHeaderBytes, count, cudaMemcpyDeviceToHost,
                                         stream);
  if (copied == cudaSuccess) copied = cudaStreamSynchronize(stream);
  if (copied != cudaSuccess) return Launched(kOp, copied);
  if (ffi::Error e = trainspec::CheckHeaders(kOp, f, headers.data(), trainspec::kHeaderBytes,
                                             count);
      e.failure()) {
    return e;
  }
  return Launched(kOp, trainspec::cuda::LaunchDequantizeSum(
                           f, data, count, static_cast<float*>(out->untyped_data()), stream));
}

ffi::Error ErrorFeedbackImpl(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer residual,
                             ffi::Result<ffi::AnyBuffer> packed,
                             ffi::Result<ffi::AnyBuffer> new_residual,
                             std::string_view compression, int64_t block) {
  PackedFormat f;
  if (ffi::Error e = trainspec::CheckErrorFeedback(compression, block, g, residual, *packed,
                                                   *new_residual, &f);
      e.failure()) {
    return e;
  }
  return Launched("error_feedback",
                  trainspec::cuda::LaunchPack(
                      f, static_cast<const float*>(g.untyped_data()),
                      static_cast<const float*>(residual.untyped_data()),
                      static_cast<uint8_t*>(packed->untyped_data()),
                      static_cast<float*>(new_residual->untyped_data()), stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecFingerprintCuda, FingerprintImpl,
                              trainspec::BindFingerprint(ffi::Ffi::Bind().Ctx<Stream>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecQuantizeCuda, QuantizeImpl,
                              trainspec::BindQuantize(ffi::Ffi::Bind().Ctx<Stream>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecDequantizeCuda, DequantizeImpl,
                              trainspec::BindDequantize(ffi::Ffi::Bind().Ctx<Stream>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecErrorFeedbackCuda, ErrorFeedbackImpl,
                              trainspec::BindErrorFeedback(ffi::Ffi::Bind().Ctx<Stream>()));
