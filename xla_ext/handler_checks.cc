// The operand checks of the handlers both platforms share (handler_checks.h).
#include "handler_checks.h"

#include <cstdio>
#include <cstring>

namespace ffi = xla::ffi;

namespace trainspec {

namespace {

std::string DescribeHeader(const PackedHeader& h) {
  char magic[9];
  std::snprintf(magic, sizeof magic, "%08x", h.magic);
  return std::string("(magic 0x") + magic + ", format " + std::to_string(h.format) +
         ", elements " + std::to_string(h.elements) + ", block " + std::to_string(h.block) + ")";
}

}  // namespace

ffi::Error CheckFingerprint(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::U32>& out) {
  if (out.element_count() != 2) {
    return ffi::Error::InvalidArgument("trainspec_fingerprint: output must hold 2 uint32 words");
  }
  if (x.element_count() > 0 && x.untyped_data() == nullptr) {
    return ffi::Error::InvalidArgument("trainspec_fingerprint: input buffer has no data");
  }
  return ffi::Error::Success();
}

ffi::Error InvalidPacking(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("trainspec_") + op + ": " + what);
}

ffi::Error MakeFormat(const char* op, std::string_view compression, int64_t block, size_t n,
                      PackedFormat* f) {
  if (compression == "bf16") {
    f->code = kFormatBf16;
    if (block != 0) {
      return InvalidPacking(op, "block must be 0 for bf16, got " + std::to_string(block));
    }
  } else if (compression == "int8") {
    f->code = kFormatInt8;
    if (block <= 0 || block % 4 != 0 || block > (int64_t{1} << 24)) {
      return InvalidPacking(op, "block must be a positive multiple of 4 up to 2^24 for int8, "
                                "got " + std::to_string(block));
    }
  } else {
    return InvalidPacking(op, "compression must be \"bf16\" or \"int8\", got \"" +
                                  std::string(compression) + "\"");
  }
  if (n > UINT32_MAX) {
    return InvalidPacking(op, std::to_string(n) + " elements exceed the header's uint32 count");
  }
  f->block = static_cast<size_t>(block);
  f->n = n;
  return ffi::Error::Success();
}

ffi::Error CheckF32(const char* op, const char* name, const ffi::AnyBuffer& b, size_t count) {
  if (b.element_type() != ffi::DataType::F32) {
    return InvalidPacking(op, std::string(name) + " must be float32");
  }
  if (b.element_count() != count) {
    return InvalidPacking(op, std::string(name) + " has " + std::to_string(b.element_count()) +
                                  " elements, expected " + std::to_string(count));
  }
  if (count > 0 && b.untyped_data() == nullptr) {
    return InvalidPacking(op, std::string(name) + " has no data");
  }
  return ffi::Error::Success();
}

ffi::Error CheckPacked(const char* op, const ffi::AnyBuffer& b, size_t bytes_each,
                       size_t* count) {
  size_t width;
  if (b.element_type() == ffi::DataType::U8) {
    width = 1;
  } else if (b.element_type() == ffi::DataType::S32) {
    width = 4;
  } else {
    return InvalidPacking(op, "packed must be uint8 or int32");
  }
  const auto dims = b.dimensions();
  if (dims.size() < 1 || static_cast<size_t>(dims.back()) * width != bytes_each) {
    return InvalidPacking(op, "packed buffers must be " + std::to_string(bytes_each) +
                                  " bytes each (last dimension) for these elements and block");
  }
  *count = b.size_bytes() / bytes_each;
  if (*count == 0) return InvalidPacking(op, "packed holds no buffer");
  if (b.untyped_data() == nullptr) return InvalidPacking(op, "packed has no data");
  return ffi::Error::Success();
}

ffi::Error CheckPacking(const char* op, std::string_view compression, int64_t block,
                        const char* name, const ffi::AnyBuffer& x, const ffi::AnyBuffer& packed,
                        PackedFormat* f) {
  size_t count = 0;
  if (ffi::Error e = MakeFormat(op, compression, block, x.element_count(), f); e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckF32(op, name, x, f->n); e.failure()) return e;
  if (ffi::Error e = CheckPacked(op, packed, f->bytes(), &count); e.failure()) return e;
  if (count != 1) return InvalidPacking(op, "packed must hold exactly one buffer");
  return ffi::Error::Success();
}

ffi::Error CheckQuantize(std::string_view compression, int64_t block, const ffi::AnyBuffer& x,
                         const ffi::AnyBuffer& packed, PackedFormat* f) {
  return CheckPacking("quantize", compression, block, "x", x, packed, f);
}

ffi::Error CheckDequantize(std::string_view compression, int64_t block,
                           const ffi::AnyBuffer& packed, const ffi::AnyBuffer& out,
                           PackedFormat* f, size_t* count) {
  constexpr const char* kOp = "dequantize";
  if (ffi::Error e = MakeFormat(kOp, compression, block, out.element_count(), f); e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckF32(kOp, "output", out, f->n); e.failure()) return e;
  return CheckPacked(kOp, packed, f->bytes(), count);
}

ffi::Error CheckErrorFeedback(std::string_view compression, int64_t block,
                              const ffi::AnyBuffer& g, const ffi::AnyBuffer& residual,
                              const ffi::AnyBuffer& packed, const ffi::AnyBuffer& new_residual,
                              PackedFormat* f) {
  constexpr const char* kOp = "error_feedback";
  if (ffi::Error e = CheckPacking(kOp, compression, block, "g", g, packed, f); e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckF32(kOp, "residual", residual, f->n); e.failure()) return e;
  return CheckF32(kOp, "new residual", new_residual, f->n);
}

ffi::Error CheckHeaders(const char* op, const PackedFormat& f, const uint8_t* headers,
                        size_t stride, size_t count) {
  const PackedHeader want = f.header();
  for (size_t r = 0; r < count; ++r) {
    PackedHeader got;
    std::memcpy(&got, headers + r * stride, kHeaderBytes);
    if (std::memcmp(&got, &want, kHeaderBytes) != 0) {
      return InvalidPacking(op, "packed buffer " + std::to_string(r) + " has header " +
                                    DescribeHeader(got) + ", expected " + DescribeHeader(want));
    }
  }
  return ffi::Error::Success();
}

}  // namespace trainspec
