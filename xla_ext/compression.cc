// Compressed gradient exchange (collectives.compression) as XLA FFI handlers: quantize one
// float32 buffer into one contiguous packed buffer, dequantize k packed buffers and sum them in
// order, and the error-feedback step (quantize g + residual, keep what the packing lost).
//
// The layout and the kernels are packed_kernels.h's; this file translates between XLA FFI and
// them. Every handler checks dtypes, sizes, the block and each packed header, and returns
// INVALID_ARGUMENT naming what is wrong; none of them can crash on a bad call.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>

#include "handlers.h"
#include "packed_kernels.h"

namespace ffi = xla::ffi;

namespace {

using trainspec::kFormatBf16;
using trainspec::kFormatInt8;
using trainspec::kHeaderBytes;
using Format = trainspec::PackedFormat;
using Header = trainspec::PackedHeader;

std::string Describe(const Header& h) {
  char magic[9];
  std::snprintf(magic, sizeof magic, "%08x", h.magic);
  return std::string("(magic 0x") + magic + ", format " + std::to_string(h.format) +
         ", elements " + std::to_string(h.elements) + ", block " + std::to_string(h.block) + ")";
}

ffi::Error Invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("trainspec_") + op + ": " + what);
}

ffi::Error MakeFormat(const char* op, std::string_view compression, int64_t block, size_t n,
                      Format* f) {
  if (compression == "bf16") {
    f->code = kFormatBf16;
    if (block != 0) return Invalid(op, "block must be 0 for bf16, got " + std::to_string(block));
  } else if (compression == "int8") {
    f->code = kFormatInt8;
    if (block <= 0 || block % 4 != 0 || block > (int64_t{1} << 24)) {
      return Invalid(op, "block must be a positive multiple of 4 up to 2^24 for int8, got " +
                             std::to_string(block));
    }
  } else {
    return Invalid(op, "compression must be \"bf16\" or \"int8\", got \"" +
                           std::string(compression) + "\"");
  }
  if (n > UINT32_MAX) {
    return Invalid(op, std::to_string(n) + " elements exceed the header's uint32 count");
  }
  f->block = static_cast<size_t>(block);
  f->n = n;
  return ffi::Error::Success();
}

// A float32 operand (any shape) of `count` elements, or an error naming it.
ffi::Error CheckF32(const char* op, const char* name, const ffi::AnyBuffer& b, size_t count) {
  if (b.element_type() != ffi::DataType::F32) {
    return Invalid(op, std::string(name) + " must be float32");
  }
  if (b.element_count() != count) {
    return Invalid(op, std::string(name) + " has " + std::to_string(b.element_count()) +
                           " elements, expected " + std::to_string(count));
  }
  if (count > 0 && b.untyped_data() == nullptr) {
    return Invalid(op, std::string(name) + " has no data");
  }
  return ffi::Error::Success();
}

// Packed buffers travel as bytes (uint8) or as int32 words (what the ext all-gather moves, with
// no conversion copy): the last dimension holds one buffer, of `bytes_each` bytes.
ffi::Error CheckPacked(const char* op, const ffi::AnyBuffer& b, size_t bytes_each,
                       size_t* count) {
  size_t width;
  if (b.element_type() == ffi::DataType::U8) {
    width = 1;
  } else if (b.element_type() == ffi::DataType::S32) {
    width = 4;
  } else {
    return Invalid(op, "packed must be uint8 or int32");
  }
  const auto dims = b.dimensions();
  if (dims.size() < 1 || static_cast<size_t>(dims.back()) * width != bytes_each) {
    return Invalid(op, "packed buffers must be " + std::to_string(bytes_each) +
                           " bytes each (last dimension) for these elements and block");
  }
  *count = b.size_bytes() / bytes_each;
  if (*count == 0) return Invalid(op, "packed holds no buffer");
  if (b.untyped_data() == nullptr) return Invalid(op, "packed has no data");
  return ffi::Error::Success();
}

// ---- handlers ----------------------------------------------------------------------------------

// The format for the float32 input `x` (called `name`) and the checks of `x` and of its one
// packed output.
ffi::Error CheckPacking(const char* op, std::string_view compression, int64_t block,
                        const char* name, const ffi::AnyBuffer& x, const ffi::AnyBuffer& packed,
                        Format* f) {
  size_t count = 0;
  if (ffi::Error e = MakeFormat(op, compression, block, x.element_count(), f); e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckF32(op, name, x, f->n); e.failure()) return e;
  if (ffi::Error e = CheckPacked(op, packed, f->bytes(), &count); e.failure()) return e;
  if (count != 1) return Invalid(op, "packed must hold exactly one buffer");
  return ffi::Error::Success();
}

ffi::Error QuantizeImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> packed,
                        std::string_view compression, int64_t block) {
  Format f;
  if (ffi::Error e = CheckPacking("quantize", compression, block, "x", x, *packed, &f);
      e.failure()) {
    return e;
  }
  trainspec::Pack(f, static_cast<const float*>(x.untyped_data()),
       static_cast<uint8_t*>(packed->untyped_data()), nullptr);
  return ffi::Error::Success();
}

ffi::Error DequantizeImpl(ffi::AnyBuffer packed, ffi::Result<ffi::AnyBuffer> out,
                          std::string_view compression, int64_t block) {
  constexpr const char* kOp = "dequantize";
  Format f;
  size_t count = 0;
  if (ffi::Error e = MakeFormat(kOp, compression, block, out->element_count(), &f); e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckF32(kOp, "output", *out, f.n); e.failure()) return e;
  if (ffi::Error e = CheckPacked(kOp, packed, f.bytes(), &count); e.failure()) return e;
  const uint8_t* data = static_cast<const uint8_t*>(packed.untyped_data());
  const Header want = f.header();
  for (size_t r = 0; r < count; ++r) {
    Header got;
    std::memcpy(&got, data + r * f.bytes(), kHeaderBytes);
    if (std::memcmp(&got, &want, kHeaderBytes) != 0) {
      return Invalid(kOp, "packed buffer " + std::to_string(r) + " has header " +
                              Describe(got) + ", expected " + Describe(want));
    }
  }
  trainspec::DequantizeSum(f, data, count, static_cast<float*>(out->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error ErrorFeedbackImpl(ffi::AnyBuffer g, ffi::AnyBuffer residual,
                             ffi::Result<ffi::AnyBuffer> packed,
                             ffi::Result<ffi::AnyBuffer> new_residual,
                             std::string_view compression, int64_t block) {
  constexpr const char* kOp = "error_feedback";
  Format f;
  if (ffi::Error e = CheckPacking(kOp, compression, block, "g", g, *packed, &f); e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckF32(kOp, "residual", residual, f.n); e.failure()) return e;
  if (ffi::Error e = CheckF32(kOp, "new residual", *new_residual, f.n); e.failure()) return e;
  const float* gd = static_cast<const float*>(g.untyped_data());
  const float* rd = static_cast<const float*>(residual.untyped_data());
  float* corrected = static_cast<float*>(new_residual->untyped_data());
  for (size_t i = 0; i < f.n; ++i) corrected[i] = gd[i] + rd[i];
  trainspec::Pack(f, corrected, static_cast<uint8_t*>(packed->untyped_data()), corrected);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecQuantize, QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x, float32
                                  .Ret<ffi::AnyBuffer>()  // packed, uint8[bytes]
                                  .Attr<std::string_view>("compression")
                                  .Attr<int64_t>("block"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecDequantize, DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // packed, uint8[k, bytes]
                                  .Ret<ffi::AnyBuffer>()  // the sum, float32[n]
                                  .Attr<std::string_view>("compression")
                                  .Attr<int64_t>("block"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecErrorFeedback, ErrorFeedbackImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // g, float32[n]
                                  .Arg<ffi::AnyBuffer>()  // residual, float32[n]
                                  .Ret<ffi::AnyBuffer>()  // packed, uint8[bytes]
                                  .Ret<ffi::AnyBuffer>()  // new residual, float32[n]
                                  .Attr<std::string_view>("compression")
                                  .Attr<int64_t>("block"));
