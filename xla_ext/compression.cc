// Compressed gradient exchange (collectives.compression) as XLA FFI handlers on the CPU: quantize
// one float32 buffer into one contiguous packed buffer, dequantize k packed buffers and sum them
// in order, and the error-feedback step (quantize g + residual, keep what the packing lost).
//
// The layout and the kernels are packed_kernels.h's, the operand checks handler_checks.h's
// (shared with the CUDA handlers); this file translates between XLA FFI and them. Every handler
// checks dtypes, sizes, the block and each packed header, and returns INVALID_ARGUMENT naming
// what is wrong; none of them can crash on a bad call.
#include <cstdint>
#include <string_view>

#include "handler_checks.h"
#include "handlers.h"
#include "packed_kernels.h"

namespace ffi = xla::ffi;

namespace {

using trainspec::PackedFormat;

ffi::Error QuantizeImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> packed,
                        std::string_view compression, int64_t block) {
  PackedFormat f;
  if (ffi::Error e = trainspec::CheckQuantize(compression, block, x, *packed, &f); e.failure()) {
    return e;
  }
  trainspec::Pack(f, static_cast<const float*>(x.untyped_data()),
                  static_cast<uint8_t*>(packed->untyped_data()), nullptr);
  return ffi::Error::Success();
}

ffi::Error DequantizeImpl(ffi::AnyBuffer packed, ffi::Result<ffi::AnyBuffer> out,
                          std::string_view compression, int64_t block) {
  PackedFormat f;
  size_t count = 0;
  if (ffi::Error e = trainspec::CheckDequantize(compression, block, packed, *out, &f, &count);
      e.failure()) {
    return e;
  }
  const uint8_t* data = static_cast<const uint8_t*>(packed.untyped_data());
  if (ffi::Error e = trainspec::CheckHeaders("dequantize", f, data, f.bytes(), count);
      e.failure()) {
    return e;
  }
  trainspec::DequantizeSum(f, data, count, static_cast<float*>(out->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error ErrorFeedbackImpl(ffi::AnyBuffer g, ffi::AnyBuffer residual,
                             ffi::Result<ffi::AnyBuffer> packed,
                             ffi::Result<ffi::AnyBuffer> new_residual,
                             std::string_view compression, int64_t block) {
  PackedFormat f;
  if (ffi::Error e = trainspec::CheckErrorFeedback(compression, block, g, residual, *packed,
                                                   *new_residual, &f);
      e.failure()) {
    return e;
  }
  const float* gd = static_cast<const float*>(g.untyped_data());
  const float* rd = static_cast<const float*>(residual.untyped_data());
  float* corrected = static_cast<float*>(new_residual->untyped_data());
  for (size_t i = 0; i < f.n; ++i) corrected[i] = gd[i] + rd[i];
  trainspec::Pack(f, corrected, static_cast<uint8_t*>(packed->untyped_data()), corrected);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecQuantize, QuantizeImpl,
                              trainspec::BindQuantize(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecDequantize, DequantizeImpl,
                              trainspec::BindDequantize(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecErrorFeedback, ErrorFeedbackImpl,
                              trainspec::BindErrorFeedback(ffi::Ffi::Bind()));
