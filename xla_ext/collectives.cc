// Collective ops as XLA FFI handlers for the CPU backend: all_reduce, reduce_scatter,
// all_gather, all_to_all, broadcast and permute between the devices of one process.
//
// Every handler takes (x, rank, group) and returns one buffer. `rank` and `group` are int32
// scalars that spec_jax/collectives/ext.py computes with lax.axis_index, so a group can be any
// subset of mesh axes (a row, a column) without the handler knowing device ids; the group
// size, the call site and the timeout are static attributes. The members meet through
// rendezvous.h, then read each other's inputs and write outputs directly (no staging copy).
//
// Determinism: every reduction combines the members' values in rank order 0, 1, ..., n-1,
// whoever computes it and whichever member arrived first, so results are bitwise identical
// run to run. bf16/f16 are accumulated in float32 and rounded once (round to nearest even).
// The kernels (reduce_kernels.h) are dispatched at run time per ISA and give the same bits on
// all of them. The work is cut into units whose bytes depend only on the shapes; members take
// them from a shared counter (rendezvous.h), so who runs a unit never changes its result.
// max/min propagate NaN, like jnp.maximum/jnp.minimum.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "handlers.h"
#include "reduce_kernels.h"
#include "rendezvous.h"

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;

namespace trainspec {
namespace {

// Below this many bytes moved in total, the last member to arrive does all the data movement
// (one wake-up per call); above it the members work in parallel. Measured on 2 cores / 8
// devices, see docs/xla_ext.md.
constexpr size_t kSmallTotalBytes = 256 * 1024;
// Reductions are cut into about this many units per member (see UnitElems), each at least
// kMinUnitBytes of output.
constexpr size_t kUnitsPerMember = 4;
constexpr size_t kMinUnitBytes = 64 * 1024;
// Group sizes beyond this are certainly a bug (a process has far fewer devices).
constexpr int64_t kMaxGroupSize = 4096;
// Outputs at least this large are written with non-temporal stores: they do not fit in cache
// anyway, and a normal store first reads the line it overwrites (read-for-ownership), which
// costs as much memory traffic as the write itself.
constexpr size_t kStreamBytes = 1 << 20;
// Outputs at least this large are fresh mmap()ed memory (glibc's mmap threshold is at most
// 32 MiB), and first-touch page faults on 4 KiB pages dominate the collective: asking for
// transparent huge pages before anyone writes into them cuts the faults 512-fold.
constexpr size_t kHugePageBytes = 32 << 20;
// Outputs at least this large have their missing pages mapped in one go (PrefaultOutput).
constexpr size_t kPrefaultBytes = 1 << 20;

enum ReduceOp : int64_t { kSum = 0, kMean = 1, kMax = 2, kMin = 3 };
const char* ReduceOpName(int64_t op) {
  switch (op) {
    case kSum: return "sum";
    case kMean: return "mean";
    case kMax: return "max";
    case kMin: return "min";
    default: return "?";
  }
}

// ---- stores ---------------------------------------------------------------------------------

// Whether the copy ops (all_gather, all_to_all, broadcast, permute) write an output of this
// size with non-temporal stores. Not for outputs that get huge pages: there each member fills
// whole fresh 2 MiB pages that the kernel has just zeroed, and cached stores were 1.5-4x
// faster than streaming ones (user and system time both, 64 MiB per device on the measured
// VM; docs/xla_ext.md). The reductions write eight outputs a slice at a time and keep
// streaming at every size (1.25-1.3x faster than cached stores at 32-64 MiB).
bool StreamCopies(size_t out_bytes) {
  return out_bytes >= kStreamBytes && out_bytes < kHugePageBytes;
}

// Copies a large block, streaming when it is large enough not to stay in cache.
void CopyOut(void* dst, const void* src, size_t bytes, bool stream) {
  if (bytes == 0) return;
  if (stream) {
    StreamCopy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
}

// Hint that a large output about to be written should be backed by huge pages (see
// kHugePageBytes). Only the 2 MiB-aligned interior is advised; failure is harmless.
void AdviseHugePages(void* out, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < kHugePageBytes) return;
  constexpr uintptr_t kHuge = 2 << 20;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(out) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(out) + bytes) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)out;
  (void)bytes;
#endif
}

// Maps the pages of a large output that are not yet backed by memory (fresh from mmap, or
// trimmed by the allocator) with one MADV_POPULATE_WRITE per missing run, instead of taking a
// page fault per 4 KiB page in the middle of the copy loop. The kernel still zeroes the pages;
// what goes is the per-fault trap, which made touch-faulting about 1.4x slower on the
// measured VM (docs/xla_ext.md). mincore() finds the missing pages (a few microseconds for
// 4 MiB), so a resident buffer costs one cheap syscall. Needs Linux 5.14; elsewhere, or if
// anything fails, the pages fault in as before.
void PrefaultOutput(void* out, size_t bytes) {
#if defined(__linux__)
  constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE, absent from older headers
  static std::atomic<bool> unsupported{false};
  // Outputs that get huge pages fault faster by touch: 5.5 GB/s against 3.9 GB/s through
  // MADV_POPULATE_WRITE, 8 threads on the measured VM.
  if (bytes < kPrefaultBytes || bytes >= kHugePageBytes ||
      unsupported.load(std::memory_order_relaxed)) {
    return;
  }
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(out) & ~(page - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(out) + bytes + page - 1) & ~(page - 1);
  const size_t pages = (hi - lo) / page;
  thread_local std::vector<unsigned char> resident;
  resident.resize(pages);
  if (mincore(reinterpret_cast<void*>(lo), hi - lo, resident.data()) != 0) return;
  for (size_t p = 0; p < pages;) {
    if (resident[p] & 1) {
      ++p;
      continue;
    }
    size_t q = p;
    while (q < pages && !(resident[q] & 1)) ++q;
    if (madvise(reinterpret_cast<void*>(lo + p * page), (q - p) * page, kPopulateWrite) != 0 &&
        errno == EINVAL) {
      unsupported.store(true, std::memory_order_relaxed);
      return;
    }
    p = q;
  }
#else
  (void)out;
  (void)bytes;
#endif
}

// ---- element types -------------------------------------------------------------------------

bool ToElemType(ffi::DataType dtype, ElemType* t) {
  switch (dtype) {
    case ffi::DataType::F32: *t = ElemType::kF32; return true;
    case ffi::DataType::F64: *t = ElemType::kF64; return true;
    case ffi::DataType::S32: *t = ElemType::kS32; return true;
    case ffi::DataType::BF16: *t = ElemType::kBF16; return true;
    case ffi::DataType::F16: *t = ElemType::kF16; return true;
    default: return false;
  }
}

RedOp ToRedOp(int64_t op) {
  switch (op) {
    case kMean: return RedOp::kMean;
    case kMax: return RedOp::kMax;
    case kMin: return RedOp::kMin;
    default: return RedOp::kSum;
  }
}

bool IsSupported(ffi::DataType dtype) {
  ElemType t;
  return ToElemType(dtype, &t);
}

// ---- shapes --------------------------------------------------------------------------------

std::vector<int64_t> Dims(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return std::vector<int64_t>(d.begin(), d.end());
}

int64_t Product(const std::vector<int64_t>& d, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < to; ++i) p *= d[i];
  return p;
}

std::string ShapeString(const std::vector<int64_t>& d) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < d.size(); ++i) s << (i ? ", " : "") << d[i];
  s << "]";
  return s.str();
}

// Copies the box `shape` from src (an array with row-major strides src_strides, starting at
// element src_offset) into dst likewise. The axes from `contiguous_from` on must be full in
// both arrays except possibly the first of them, so each run of prod(shape[contiguous_from:])
// elements is contiguous on both sides.
void CopyBox(const uint8_t* src, const std::vector<int64_t>& src_strides, int64_t src_offset,
             uint8_t* dst, const std::vector<int64_t>& dst_strides, int64_t dst_offset,
             const std::vector<int64_t>& shape, size_t contiguous_from, size_t elem_bytes,
             bool stream) {
  const size_t run = static_cast<size_t>(Product(shape, contiguous_from, shape.size())) *
                     elem_bytes;
  if (run == 0) return;
  for (size_t i = 0; i < contiguous_from; ++i) {
    if (shape[i] == 0) return;
  }
  std::vector<int64_t> idx(contiguous_from, 0);
  for (;;) {
    int64_t so = src_offset, doff = dst_offset;
    for (size_t i = 0; i < contiguous_from; ++i) {
      so += idx[i] * src_strides[i];
      doff += idx[i] * dst_strides[i];
    }
    CopyOut(dst + doff * elem_bytes, src + so * elem_bytes, run, stream);
    size_t axis = contiguous_from;
    while (axis > 0) {  // odometer increment over the outer axes
      --axis;
      if (++idx[axis] < shape[axis]) break;
      idx[axis] = 0;
      if (axis == 0) return;
    }
    if (contiguous_from == 0) return;
  }
}

std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& dims) {
  std::vector<int64_t> s(dims.size(), 1);
  for (size_t i = dims.size(); i-- > 1;) s[i - 1] = s[i] * dims[i];
  return s;
}

// ---- the common part of every handler ------------------------------------------------------

struct Call {
  const char* op;
  MeetingKey key;
  int rank;
  int n;
  int64_t timeout_ms;
};

ffi::Error Invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("trainspec ") + op + ": " + what);
}

// Validates what every collective shares and reads the rank and group operands.
ffi::Error Prepare(const char* op, ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer rank,
                   ffi::AnyBuffer group, const ffi::AnyBuffer& out, int64_t call_site,
                   int64_t group_size, int64_t timeout_ms, Call* call) {
  if (group_size < 1 || group_size > kMaxGroupSize) {
    return Invalid(op, "group_size must be in [1, " + std::to_string(kMaxGroupSize) +
                           "], got " + std::to_string(group_size));
  }
  if (timeout_ms < 1) {
    return Invalid(op, "timeout_ms must be positive, got " + std::to_string(timeout_ms));
  }
  if (call_site < 0) return Invalid(op, "call_site must be non-negative");
  for (const ffi::AnyBuffer* b : {&rank, &group}) {
    if (b->element_type() != ffi::DataType::S32 || b->element_count() != 1 ||
        b->untyped_data() == nullptr) {
      return Invalid(op, "rank and group must be int32 scalars");
    }
  }
  if (!IsSupported(x.element_type())) {
    return Invalid(op, "unsupported dtype (supported: float32, bfloat16, float16, float64, int32)");
  }
  if (out.element_type() != x.element_type()) {
    return Invalid(op, "output dtype differs from input dtype");
  }
  if ((x.element_count() > 0 && x.untyped_data() == nullptr) ||
      (out.element_count() > 0 && out.untyped_data() == nullptr)) {
    return Invalid(op, "buffer has no data");
  }
  const int32_t r = *static_cast<const int32_t*>(rank.untyped_data());
  const int32_t g = *static_cast<const int32_t*>(group.untyped_data());
  if (r < 0 || r >= group_size) {
    return Invalid(op, "rank " + std::to_string(r) + " out of range for group size " +
                           std::to_string(group_size));
  }
  if (g < 0) return Invalid(op, "group id must be non-negative, got " + std::to_string(g));
  *call = Call{op, MeetingKey{run_id.run_id, call_site, g}, r, static_cast<int>(group_size),
               timeout_ms};
  return ffi::Error::Success();
}

Plan PlanFor(size_t total_bytes) {
  return total_bytes <= kSmallTotalBytes ? Plan::kLastArriverForAll : Plan::kShared;
}

// Elements per unit of a reduction producing `count` elements in a group of n: about
// kUnitsPerMember units per member so that running members can take over the work of
// descheduled ones, none under kMinUnitBytes (the cost of taking a unit stays negligible),
// and a whole number of kernel steps (128 bytes) so that units start on cache lines.
size_t UnitElems(size_t count, int n, size_t elem) {
  const size_t step = 128 / elem;
  size_t unit = (count + kUnitsPerMember * n - 1) / (kUnitsPerMember * n);
  unit = std::max(unit, kMinUnitBytes / elem);
  return (unit + step - 1) / step * step;
}

ffi::Error Run(const Call& c, const Signature& sig, const ffi::AnyBuffer& x,
               ffi::Result<ffi::AnyBuffer>& out, size_t total_bytes, size_t units,
               const Share& share) {
  AdviseHugePages(out->untyped_data(), out->size_bytes());  // before any member writes to it
  PrefaultOutput(out->untyped_data(), out->size_bytes());
  // The fence makes a unit's non-temporal stores visible before Meet() counts it as done.
  const Share fenced = [&share](const std::vector<Member>& m, size_t unit) {
    share(m, unit);
    StoreFence();
  };
  std::string err = Meet(c.op, c.key, c.rank, c.n, sig, Member{x.untyped_data(),
                                                              out->untyped_data()},
                         c.timeout_ms, PlanFor(total_bytes), units, fenced);
  if (!err.empty()) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

// ---- all_reduce ----------------------------------------------------------------------------

ffi::Error AllReduceImpl(ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer rank,
                         ffi::AnyBuffer group, ffi::Result<ffi::AnyBuffer> out,
                         int64_t call_site, int64_t group_size, int64_t timeout_ms,
                         int64_t reduce_op) {
  constexpr const char* kOp = "all_reduce";
  Call c;
  if (auto e = Prepare(kOp, run_id, x, rank, group, *out, call_site, group_size, timeout_ms, &c);
      e.failure()) {
    return e;
  }
  if (reduce_op < kSum || reduce_op > kMin) {
    return Invalid(kOp, "reduce_op must be 0 (sum), 1 (mean), 2 (max) or 3 (min), got " +
                            std::to_string(reduce_op));
  }
  if (reduce_op == kMean && x.element_type() == ffi::DataType::S32) {
    return Invalid(kOp, "mean of int32 is not an int32 (divide the sum instead)");
  }
  if (Dims(x) != Dims(*out)) {
    return Invalid(kOp, "output shape " + ShapeString(Dims(*out)) + " differs from input " +
                            ShapeString(Dims(x)));
  }
  const size_t count = x.element_count();
  const int n = c.n;
  // Each member reduces one contiguous slice (cache-line aligned) and writes it into every
  // member's output: reduce-scatter and all-gather in one pass, with no staging buffer.
  // Unit u reduces elements [u * unit, (u + 1) * unit) of all inputs (rank order) and writes
  // them into every member's output: reduce-scatter and all-gather in one pass, reading each
  // input once and writing each output once, with no staging buffer.
  const size_t elem = ffi::ByteWidth(x.element_type());
  const size_t unit = UnitElems(count, n, elem);
  const size_t units = (count + unit - 1) / unit;
  const bool stream = out->size_bytes() >= kStreamBytes;
  ElemType type;
  ToElemType(x.element_type(), &type);
  const RedOp op = ToRedOp(reduce_op);
  Share share = [count, unit, elem, n, type, op, stream](const std::vector<Member>& m,
                                                          size_t u) {
    const size_t lo = u * unit;
    const size_t hi = std::min(count, lo + unit);
    std::vector<const void*> srcs(n);
    std::vector<void*> dsts(n);
    for (int s = 0; s < n; ++s) {
      srcs[s] = static_cast<const uint8_t*>(m[s].in) + lo * elem;
      dsts[s] = static_cast<uint8_t*>(m[s].out) + lo * elem;
    }
    ReduceInto(type, op, srcs.data(), n, dsts.data(), n, hi - lo, stream);
  };
  const Signature sig{static_cast<int>(x.element_type()), Dims(x), Dims(*out), {reduce_op}};
  return Run(c, sig, x, out, x.size_bytes() * n, units, share);
}

// ---- reduce_scatter ------------------------------------------------------------------------

ffi::Error ReduceScatterImpl(ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer rank,
                             ffi::AnyBuffer group, ffi::Result<ffi::AnyBuffer> out,
                             int64_t call_site, int64_t group_size, int64_t timeout_ms,
                             int64_t reduce_op, int64_t scatter_dimension) {
  constexpr const char* kOp = "reduce_scatter";
  Call c;
  if (auto e = Prepare(kOp, run_id, x, rank, group, *out, call_site, group_size, timeout_ms, &c);
      e.failure()) {
    return e;
  }
  if (reduce_op != kSum && reduce_op != kMean) {
    return Invalid(kOp, "reduce_op must be 0 (sum) or 1 (mean)");
  }
  if (reduce_op == kMean && x.element_type() == ffi::DataType::S32) {
    return Invalid(kOp, "mean of int32 is not an int32 (divide the sum instead)");
  }
  const std::vector<int64_t> in_dims = Dims(x), out_dims = Dims(*out);
  const int64_t d = scatter_dimension;
  if (d < 0 || d >= static_cast<int64_t>(in_dims.size())) {
    return Invalid(kOp, "scatter_dimension " + std::to_string(d) + " out of range for shape " +
                            ShapeString(in_dims));
  }
  if (in_dims[d] % c.n != 0) {
    return Invalid(kOp, "dimension " + std::to_string(d) + " of shape " + ShapeString(in_dims) +
                            " is not divisible by the group size " + std::to_string(c.n));
  }
  std::vector<int64_t> want = in_dims;
  want[d] /= c.n;
  if (out_dims != want) {
    return Invalid(kOp, "output shape " + ShapeString(out_dims) + " should be " +
                            ShapeString(want));
  }
  const size_t outer = Product(in_dims, 0, d);
  const size_t dim = in_dims[d];
  const size_t inner = Product(in_dims, d + 1, in_dims.size());
  const size_t row = dim / c.n * inner;  // one member's part of one outer row
  const int n = c.n;
  const bool stream = out->size_bytes() >= kStreamBytes;
  const size_t elem = ffi::ByteWidth(x.element_type());
  ElemType type;
  ToElemType(x.element_type(), &type);
  const RedOp op = ToRedOp(reduce_op);
  // Block b of every input is reduced straight into member b's output: each input byte is
  // read once and each output byte written once. With the scatter dimension leading (outer
  // == 1) a block is one contiguous run, cut into pieces so that units stay small; otherwise
  // a unit is one member's block in every outer row.
  const size_t piece = outer == 1 ? UnitElems(n * row, n, elem) : row;
  const size_t pieces = outer == 1 && row > 0 ? (row + piece - 1) / piece : 1;
  const size_t units = row == 0 ? 0 : static_cast<size_t>(n) * pieces;
  Share share = [outer, dim, inner, row, piece, pieces, elem, n, type, op, stream](
                    const std::vector<Member>& m, size_t u) {
    const size_t b = u / pieces;
    const size_t lo = (u % pieces) * piece;
    const size_t len = std::min(row, lo + piece) - lo;
    std::vector<const void*> srcs(n);
    for (size_t o = 0; o < outer; ++o) {
      for (int s = 0; s < n; ++s) {
        srcs[s] = static_cast<const uint8_t*>(m[s].in) + (o * dim * inner + b * row + lo) * elem;
      }
      void* dst = static_cast<uint8_t*>(m[b].out) + (o * row + lo) * elem;
      ReduceInto(type, op, srcs.data(), n, &dst, 1, len, stream);
    }
  };
  const Signature sig{static_cast<int>(x.element_type()), in_dims, out_dims, {reduce_op, d}};
  return Run(c, sig, x, out, x.size_bytes(), units, share);
}

// ---- all_gather ----------------------------------------------------------------------------

ffi::Error AllGatherImpl(ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer rank,
                         ffi::AnyBuffer group, ffi::Result<ffi::AnyBuffer> out,
                         int64_t call_site, int64_t group_size, int64_t timeout_ms,
                         int64_t axis) {
  constexpr const char* kOp = "all_gather";
  Call c;
  if (auto e = Prepare(kOp, run_id, x, rank, group, *out, call_site, group_size, timeout_ms, &c);
      e.failure()) {
    return e;
  }
  const std::vector<int64_t> in_dims = Dims(x), out_dims = Dims(*out);
  if (axis < 0 || axis >= static_cast<int64_t>(in_dims.size())) {
    return Invalid(kOp, "axis " + std::to_string(axis) + " out of range for shape " +
                            ShapeString(in_dims));
  }
  std::vector<int64_t> want = in_dims;
  want[axis] *= c.n;
  if (out_dims != want) {
    return Invalid(kOp, "output shape " + ShapeString(out_dims) + " should be " +
                            ShapeString(want));
  }
  const size_t outer = Product(in_dims, 0, axis);
  const size_t block = static_cast<size_t>(Product(in_dims, axis, in_dims.size())) *
                       ffi::ByteWidth(x.element_type());  // one member's part of an outer row
  const int n = c.n;
  const bool stream = StreamCopies(out->size_bytes());
  Share share = [outer, block, n, stream](const std::vector<Member>& m, size_t r) {
    uint8_t* dst = static_cast<uint8_t*>(m[r].out);
    for (size_t o = 0; o < outer; ++o) {
      for (int s = 0; s < n; ++s) {
        CopyOut(dst + (o * n + s) * block, static_cast<const uint8_t*>(m[s].in) + o * block,
                block, stream);
      }
    }
  };
  const Signature sig{static_cast<int>(x.element_type()), in_dims, out_dims, {axis}};
  return Run(c, sig, x, out, out->size_bytes() * n, n, share);
}

// ---- all_to_all ----------------------------------------------------------------------------

ffi::Error AllToAllImpl(ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer rank,
                        ffi::AnyBuffer group, ffi::Result<ffi::AnyBuffer> out,
                        int64_t call_site, int64_t group_size, int64_t timeout_ms,
                        int64_t split_axis, int64_t concat_axis) {
  constexpr const char* kOp = "all_to_all";
  Call c;
  if (auto e = Prepare(kOp, run_id, x, rank, group, *out, call_site, group_size, timeout_ms, &c);
      e.failure()) {
    return e;
  }
  const std::vector<int64_t> in_dims = Dims(x), out_dims = Dims(*out);
  const int64_t nd = static_cast<int64_t>(in_dims.size());
  if (split_axis < 0 || split_axis >= nd || concat_axis < 0 || concat_axis >= nd) {
    return Invalid(kOp, "split_axis/concat_axis out of range for shape " + ShapeString(in_dims));
  }
  if (in_dims[split_axis] % c.n != 0) {
    return Invalid(kOp, "dimension " + std::to_string(split_axis) + " of shape " +
                            ShapeString(in_dims) + " is not divisible by the group size " +
                            std::to_string(c.n));
  }
  std::vector<int64_t> chunk = in_dims;  // what one member sends to one other member
  chunk[split_axis] /= c.n;
  std::vector<int64_t> want = chunk;
  want[concat_axis] *= c.n;
  if (out_dims != want) {
    return Invalid(kOp, "output shape " + ShapeString(out_dims) + " should be " +
                            ShapeString(want));
  }
  const std::vector<int64_t> in_strides = RowMajorStrides(in_dims);
  const std::vector<int64_t> out_strides = RowMajorStrides(out_dims);
  // From the later of the two axes on, both the source chunk and its destination are
  // contiguous runs (see CopyBox).
  const size_t contiguous_from = static_cast<size_t>(std::max(split_axis, concat_axis));
  const size_t elem = ffi::ByteWidth(x.element_type());
  const int n = c.n;
  const bool stream = StreamCopies(out->size_bytes());
  Share share = [=](const std::vector<Member>& m, size_t r) {
    for (int s = 0; s < n; ++s) {
      CopyBox(static_cast<const uint8_t*>(m[s].in), in_strides,
              r * chunk[split_axis] * in_strides[split_axis], static_cast<uint8_t*>(m[r].out),
              out_strides, s * chunk[concat_axis] * out_strides[concat_axis], chunk,
              contiguous_from, elem, stream);
    }
  };
  const Signature sig{static_cast<int>(x.element_type()), in_dims, out_dims,
                      {split_axis, concat_axis}};
  return Run(c, sig, x, out, x.size_bytes() * n, n, share);
}

// ---- broadcast -----------------------------------------------------------------------------

ffi::Error BroadcastImpl(ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer rank,
                         ffi::AnyBuffer group, ffi::Result<ffi::AnyBuffer> out,
                         int64_t call_site, int64_t group_size, int64_t timeout_ms,
                         int64_t root) {
  constexpr const char* kOp = "broadcast";
  Call c;
  if (auto e = Prepare(kOp, run_id, x, rank, group, *out, call_site, group_size, timeout_ms, &c);
      e.failure()) {
    return e;
  }
  if (root < 0 || root >= c.n) {
    return Invalid(kOp, "root " + std::to_string(root) + " out of range for group size " +
                            std::to_string(c.n));
  }
  if (Dims(x) != Dims(*out)) return Invalid(kOp, "output shape differs from input shape");
  const size_t bytes = x.size_bytes();
  const bool stream = StreamCopies(bytes);
  Share share = [bytes, root, stream](const std::vector<Member>& m, size_t r) {
    CopyOut(m[r].out, m[root].in, bytes, stream);
  };
  const Signature sig{static_cast<int>(x.element_type()), Dims(x), Dims(*out), {root}};
  return Run(c, sig, x, out, bytes * c.n, c.n, share);
}

// ---- permute -------------------------------------------------------------------------------

ffi::Error PermuteImpl(ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer rank,
                       ffi::AnyBuffer group, ffi::Result<ffi::AnyBuffer> out, int64_t call_site,
                       int64_t group_size, int64_t timeout_ms,
                       ffi::Span<const int64_t> sources) {
  constexpr const char* kOp = "permute";
  Call c;
  if (auto e = Prepare(kOp, run_id, x, rank, group, *out, call_site, group_size, timeout_ms, &c);
      e.failure()) {
    return e;
  }
  if (static_cast<int64_t>(sources.size()) != c.n) {
    return Invalid(kOp, "sources must have one entry per rank (" + std::to_string(c.n) +
                            "), got " + std::to_string(sources.size()));
  }
  std::vector<uint8_t> used(c.n, 0);
  std::vector<int64_t> src(sources.begin(), sources.end());
  for (int64_t s : src) {
    if (s < -1 || s >= c.n) {
      return Invalid(kOp, "source rank " + std::to_string(s) + " out of range");
    }
    if (s >= 0 && used[s]++) {
      return Invalid(kOp, "source rank " + std::to_string(s) + " sends to two ranks");
    }
  }
  if (Dims(x) != Dims(*out)) return Invalid(kOp, "output shape differs from input shape");
  const size_t bytes = x.size_bytes();
  const bool stream = StreamCopies(bytes);
  Share share = [bytes, src, stream](const std::vector<Member>& m, size_t r) {
    if (bytes == 0) return;
    if (src[r] < 0) {
      std::memset(m[r].out, 0, bytes);  // like lax.ppermute: ranks nobody sends to get zeros
    } else {
      CopyOut(m[r].out, m[src[r]].in, bytes, stream);
    }
  };
  Signature sig{static_cast<int>(x.element_type()), Dims(x), Dims(*out), src};
  return Run(c, sig, x, out, bytes * c.n, c.n, share);
}

}  // namespace
}  // namespace trainspec

// The operands and attributes shared by every collective, in handler-argument order.
#define TRAINSPEC_COLLECTIVE_BINDING()        \
  ffi::Ffi::Bind()                            \
      .Ctx<ffi::RunId>()                      \
      .Arg<ffi::AnyBuffer>()     /* x */      \
      .Arg<ffi::AnyBuffer>()     /* rank */   \
      .Arg<ffi::AnyBuffer>()     /* group */  \
      .Ret<ffi::AnyBuffer>()                  \
      .Attr<int64_t>("call_site")             \
      .Attr<int64_t>("group_size")            \
      .Attr<int64_t>("timeout_ms")

XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecAllReduce, trainspec::AllReduceImpl,
                              TRAINSPEC_COLLECTIVE_BINDING().Attr<int64_t>("reduce_op"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecReduceScatter, trainspec::ReduceScatterImpl,
                              TRAINSPEC_COLLECTIVE_BINDING()
                                  .Attr<int64_t>("reduce_op")
                                  .Attr<int64_t>("scatter_dimension"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecAllGather, trainspec::AllGatherImpl,
                              TRAINSPEC_COLLECTIVE_BINDING().Attr<int64_t>("axis"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecAllToAll, trainspec::AllToAllImpl,
                              TRAINSPEC_COLLECTIVE_BINDING()
                                  .Attr<int64_t>("split_axis")
                                  .Attr<int64_t>("concat_axis"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecBroadcast, trainspec::BroadcastImpl,
                              TRAINSPEC_COLLECTIVE_BINDING().Attr<int64_t>("root"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecPermute, trainspec::PermuteImpl,
                              TRAINSPEC_COLLECTIVE_BINDING()
                                  .Attr<ffi::Span<const int64_t>>("sources"));
