// The operand checks and bindings of the handlers that exist on both platforms (fingerprint and
// the packed buffers), shared by the CPU handlers (fingerprint.cc, compression.cc) and the CUDA
// ones (cuda/handlers.cc): dtypes, sizes, the block and the compression name, each failure an
// INVALID_ARGUMENT naming the operand. Nothing here reads a buffer's contents (CheckHeaders reads
// a host copy), so the same checks serve host and device memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "packed_format.h"
#include "xla/ffi/api/ffi.h"

namespace trainspec {

// trainspec_fingerprint: any input, two uint32 words out.
xla::ffi::Error CheckFingerprint(const xla::ffi::AnyBuffer& x,
                                 const xla::ffi::Buffer<xla::ffi::U32>& out);
template <typename Binding>
auto BindFingerprint(Binding b) {
  return std::move(b).template Arg<xla::ffi::AnyBuffer>()  // any buffer
      .template Ret<xla::ffi::Buffer<xla::ffi::U32>>();  // uint32[2]
}

xla::ffi::Error InvalidPacking(const char* op, const std::string& what);

// The format of n elements under `compression` ("bf16" or "int8") and `block`.
xla::ffi::Error MakeFormat(const char* op, std::string_view compression, int64_t block, size_t n,
                           PackedFormat* f);

// A float32 operand (any shape) of `count` elements.
xla::ffi::Error CheckF32(const char* op, const char* name, const xla::ffi::AnyBuffer& b,
                         size_t count);

// Packed buffers travel as bytes (uint8) or as int32 words (what the ext all-gather moves, with
// no conversion copy): the last dimension holds one buffer, of `bytes_each` bytes; `count` is
// how many buffers `b` holds.
xla::ffi::Error CheckPacked(const char* op, const xla::ffi::AnyBuffer& b, size_t bytes_each,
                            size_t* count);

// The format for the float32 input `x` (called `name`) and the checks of `x` and of its one
// packed output.
xla::ffi::Error CheckPacking(const char* op, std::string_view compression, int64_t block,
                             const char* name, const xla::ffi::AnyBuffer& x,
                             const xla::ffi::AnyBuffer& packed, PackedFormat* f);

// Each handler's operands, all checked: quantize (x -> one packed buffer), dequantize (count
// packed buffers -> out; the headers are checked separately, from host memory), error feedback
// (g, residual -> one packed buffer, new residual).
xla::ffi::Error CheckQuantize(std::string_view compression, int64_t block,
                              const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& packed,
                              PackedFormat* f);
xla::ffi::Error CheckDequantize(std::string_view compression, int64_t block,
                                const xla::ffi::AnyBuffer& packed, const xla::ffi::AnyBuffer& out,
                                PackedFormat* f, size_t* count);
xla::ffi::Error CheckErrorFeedback(std::string_view compression, int64_t block,
                                   const xla::ffi::AnyBuffer& g,
                                   const xla::ffi::AnyBuffer& residual,
                                   const xla::ffi::AnyBuffer& packed,
                                   const xla::ffi::AnyBuffer& new_residual, PackedFormat* f);

// The operands and attributes of each handler, after what the caller binds first (nothing on the
// CPU, the stream on CUDA): one list for both platforms.
template <typename Binding>
auto BindQuantize(Binding b) {
  return std::move(b).template Arg<xla::ffi::AnyBuffer>()  // x, float32
      .template Ret<xla::ffi::AnyBuffer>()  // packed, uint8[bytes]
      .template Attr<std::string_view>("compression")
      .template Attr<int64_t>("block");
}
template <typename Binding>
auto BindDequantize(Binding b) {
  return std::move(b).template Arg<xla::ffi::AnyBuffer>()  // packed, uint8[k, bytes]
      .template Ret<xla::ffi::AnyBuffer>()  // the sum, float32[n]
      .template Attr<std::string_view>("compression")
      .template Attr<int64_t>("block");
}
template <typename Binding>
auto BindErrorFeedback(Binding b) {
  return std::move(b).template Arg<xla::ffi::AnyBuffer>()  // g, float32[n]
      .template Arg<xla::ffi::AnyBuffer>()  // residual, float32[n]
      .template Ret<xla::ffi::AnyBuffer>()  // packed, uint8[bytes]
      .template Ret<xla::ffi::AnyBuffer>()  // new residual, float32[n]
      .template Attr<std::string_view>("compression")
      .template Attr<int64_t>("block");
}

// The headers of `count` packed buffers, `stride` bytes apart in host memory, against f's.
xla::ffi::Error CheckHeaders(const char* op, const PackedFormat& f, const uint8_t* headers,
                             size_t stride, size_t count);

}  // namespace trainspec
