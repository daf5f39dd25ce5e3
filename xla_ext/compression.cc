// Compressed gradient exchange (collectives.compression) as XLA FFI handlers: quantize one
// float32 buffer into one contiguous packed buffer, dequantize k packed buffers and sum them in
// order, and the error-feedback step (quantize g + residual, keep what the packing lost).
//
// Packed layout (docs/xla_ext.md; NumPy reference spec_jax/core/packed.py), little-endian,
// every field at a multiple of 4 bytes from the start:
//   header  16 bytes: uint32 magic "TSQ1", uint32 format (1 bf16, 2 int8), uint32 elements n,
//           uint32 block (int8: elements per scale; bf16: 0)
//   int8:   float32 scale[blocks], then int8 payload[blocks * block] (last block zero-padded)
//   bf16:   uint16 payload[n], then one zero uint16 if n is odd
// The arithmetic is float32 in the order of the jnp kernels (spec_jax/collectives/compression.py)
// and this file is compiled without FMA contraction, so the two paths agree bit for bit (tested).
// Every handler checks dtypes, sizes, the block and each packed header, and returns
// INVALID_ARGUMENT naming what is wrong; none of them can crash on a bad call.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>

#include "handlers.h"

namespace ffi = xla::ffi;

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the packed layout is little-endian");

constexpr uint32_t kMagic = 0x31515354;  // the bytes "TSQ1"
constexpr uint32_t kFormatBf16 = 1;
constexpr uint32_t kFormatInt8 = 2;
constexpr size_t kHeaderBytes = 16;
constexpr float kInt8Max = 127.0f;
// scale = absmax * fl(1/127): the spec defines the scale by this multiplication (what XLA makes
// of a division by the constant 127), not as a rounded quotient; then truncated to 17
// significant bits, so that q * scale (|q| <= 127: 7 bits) is exact in float32 and no FMA
// contraction, on either side, can change a sum or a residual.
constexpr float kInvInt8Max = 1.0f / 127.0f;
constexpr uint32_t kScaleMask = 0xFFFFFF80u;

struct Header {
  uint32_t magic, format, elements, block;
};

// What a packed buffer of n elements looks like, from the handler's attributes.
struct Format {
  uint32_t code = 0;
  size_t block = 0;  // 0 for bf16
  size_t n = 0;

  size_t blocks() const { return code == kFormatInt8 ? (n + block - 1) / block : 0; }
  size_t scales_offset() const { return kHeaderBytes; }
  size_t payload_offset() const { return kHeaderBytes + 4 * blocks(); }
  size_t bytes() const {
    return code == kFormatInt8 ? payload_offset() + blocks() * block
                               : kHeaderBytes + 2 * (n + n % 2);
  }
  Header header() const {
    return Header{kMagic, code, static_cast<uint32_t>(n), static_cast<uint32_t>(block)};
  }
};

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

// ---- kernels -----------------------------------------------------------------------------------
// Written as branch-free loops over contiguous elements so that the compiler vectorizes them
// (compression.cc is built with -O3); vectorizing runs across elements and reorders nothing.

// Round to nearest, ties to even; a NaN becomes the quiet NaN of its sign (as XLA converts).
inline uint16_t ToBf16Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = ((b >> 16) & 0x8000u) | 0x7FC0u;
  return static_cast<uint16_t>((b & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

inline float FromBf16Bits(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// 1.5 * 2^23: for |v| <= 127, (v + kRoundToInt) - kRoundToInt is v rounded to an integer in
// the FPU's rounding mode, round to nearest even (no libm call, which would not vectorize).
constexpr float kRoundToInt = 12582912.0f;

// One int8 block of `len` <= block elements (the rest of the block is padding): the scale
// absmax * fl(1/127) & kScaleMask (NaN if any element is NaN), and
// q = clamp(rint(x * fl(1/s)), -127, 127) with s = scale if scale > 0 else 1, a NaN product
// giving 0 -- the jnp kernel's operations (XLA turns its division by the broadcast scale into
// this multiplication). Clamping before rounding gives the same integers: the bounds are
// integers and both steps are monotonic.
float QuantizeBlock(const float* x, size_t len, size_t block, int8_t* q) {
  float absmax = 0.0f;
  int any_nan = 0;
  for (size_t i = 0; i < len; ++i) {
    const float a = std::fabs(x[i]);
    any_nan |= a != a;
    absmax = a > absmax ? a : absmax;
  }
  if (any_nan) absmax = std::numeric_limits<float>::quiet_NaN();
  float scale = absmax * kInvInt8Max;
  uint32_t bits;
  std::memcpy(&bits, &scale, 4);
  bits &= kScaleMask;
  std::memcpy(&scale, &bits, 4);
  const float inverse = 1.0f / (scale > 0.0f ? scale : 1.0f);
  for (size_t i = 0; i < len; ++i) {
    float v = x[i] * inverse;
    v = v < -kInt8Max ? -kInt8Max : v;  // a NaN passes both comparisons unchanged
    v = v > kInt8Max ? kInt8Max : v;
    const float r = v != v ? 0.0f : (v + kRoundToInt) - kRoundToInt;
    q[i] = static_cast<int8_t>(static_cast<int32_t>(r));
  }
  std::memset(q + len, 0, block - len);
  return scale;
}

void WriteHeader(const Format& f, uint8_t* packed) {
  const Header h = f.header();
  std::memcpy(packed, &h, kHeaderBytes);
}

// Packs x (f.n elements) into `packed`; with `lost` non-null also stores x - dequantized(x)
// there (x may alias `lost`: each element is read before it is overwritten).
void Pack(const Format& f, const float* x, uint8_t* packed, float* lost) {
  WriteHeader(f, packed);
  if (f.code == kFormatBf16) {
    uint8_t* payload = packed + kHeaderBytes;
    for (size_t i = 0; i < f.n; ++i) {
      const uint16_t h = ToBf16Bits(x[i]);
      std::memcpy(payload + 2 * i, &h, 2);
    }
    if (lost) {
      for (size_t i = 0; i < f.n; ++i) lost[i] = x[i] - FromBf16Bits(ToBf16Bits(x[i]));
    }
    if (f.n % 2) std::memset(payload + 2 * f.n, 0, 2);
    return;
  }
  int8_t* payload = reinterpret_cast<int8_t*>(packed + f.payload_offset());
  for (size_t b = 0; b < f.blocks(); ++b) {
    const size_t start = b * f.block;
    const size_t len = std::min(f.block, f.n - start);
    const float scale = QuantizeBlock(x + start, len, f.block, payload + start);
    std::memcpy(packed + f.scales_offset() + 4 * b, &scale, 4);
    if (lost) {
      const int8_t* q = payload + start;
      for (size_t i = 0; i < len; ++i) {
        lost[start + i] = x[start + i] - static_cast<float>(q[i]) * scale;
      }
    }
  }
}

// out[0, len) (=, or += when `add`) one stretch of dequantized values.
inline void AccumulateBf16(const uint8_t* payload, size_t len, bool add, float* out) {
  if (add) {
    for (size_t i = 0; i < len; ++i) {
      uint16_t h;
      std::memcpy(&h, payload + 2 * i, 2);
      out[i] = out[i] + FromBf16Bits(h);
    }
  } else {
    for (size_t i = 0; i < len; ++i) {
      uint16_t h;
      std::memcpy(&h, payload + 2 * i, 2);
      out[i] = FromBf16Bits(h);
    }
  }
}

inline void AccumulateInt8(const int8_t* q, float scale, size_t len, bool add, float* out) {
  if (add) {
    for (size_t i = 0; i < len; ++i) out[i] = out[i] + static_cast<float>(q[i]) * scale;
  } else {
    for (size_t i = 0; i < len; ++i) out[i] = static_cast<float>(q[i]) * scale;
  }
}

// out = sum over the k packed buffers of their dequantized values, in buffer order.
void DequantizeSum(const Format& f, const uint8_t* packed, size_t k, float* out) {
  const size_t bytes = f.bytes();
  for (size_t r = 0; r < k; ++r) {
    const uint8_t* p = packed + r * bytes;
    if (f.code == kFormatBf16) {
      AccumulateBf16(p + kHeaderBytes, f.n, r > 0, out);
      continue;
    }
    const int8_t* payload = reinterpret_cast<const int8_t*>(p + f.payload_offset());
    for (size_t b = 0; b < f.blocks(); ++b) {
      float scale;
      std::memcpy(&scale, p + f.scales_offset() + 4 * b, 4);
      const size_t start = b * f.block;
      AccumulateInt8(payload + start, scale, std::min(f.block, f.n - start), r > 0, out + start);
    }
  }
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
  Pack(f, static_cast<const float*>(x.untyped_data()),
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
  DequantizeSum(f, data, count, static_cast<float*>(out->untyped_data()));
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
  Pack(f, corrected, static_cast<uint8_t*>(packed->untyped_data()), corrected);
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
