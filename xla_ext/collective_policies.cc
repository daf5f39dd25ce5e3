// The per-op policies of the collective runner (see collective_policies.h).
#include "collective_policies.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>

#include "output_pages.h"

namespace trainspec {
namespace {

// Reductions are cut into about this many units per member (see UnitElems), each at least
// kMinUnitBytes of output.
constexpr size_t kUnitsPerMember = 4;
constexpr size_t kMinUnitBytes = 64 * 1024;
// Outputs at least this large are written with non-temporal stores: they do not fit in cache
// anyway, and a normal store first reads the line it overwrites (read-for-ownership), which
// costs as much memory traffic as the write itself.
constexpr size_t kStreamBytes = 1 << 20;

std::string ShapeString(const std::vector<int64_t>& d) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < d.size(); ++i) s << (i ? ", " : "") << d[i];
  s << "]";
  return s.str();
}

size_t Product(const std::vector<int64_t>& d, size_t from, size_t to) {
  size_t p = 1;
  for (size_t i = from; i < to; ++i) p *= static_cast<size_t>(d[i]);
  return p;
}

// Whether the copy ops write an output of this size with non-temporal stores. Not for
// outputs that get huge pages: there each member fills whole fresh 2 MiB pages that the
// kernel has just zeroed, and cached stores were 1.5-4x faster (docs/xla_ext.md). The
// reductions write eight outputs a slice at a time and stream at every size from 1 MiB.
bool StreamCopies(size_t out_bytes) {
  return out_bytes >= kStreamBytes && out_bytes < kHugePageBytes;
}

void CopyOut(void* dst, const void* src, size_t bytes, bool stream) {
  if (bytes == 0) return;
  if (stream) {
    StreamCopy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
}

// Elements per unit of a reduction producing `count` elements in a group of n: about
// kUnitsPerMember units per member so that running members can take over the work of
// descheduled ones, none under kMinUnitBytes (the cost of taking a unit stays negligible),
// and a whole number of kernel steps (128 bytes) so that units start on cache lines.
size_t UnitElems(size_t count, size_t n, size_t elem) {
  const size_t step = 128 / elem;
  size_t unit = (count + kUnitsPerMember * n - 1) / (kUnitsPerMember * n);
  unit = std::max(unit, kMinUnitBytes / elem);
  return (unit + step - 1) / step * step;
}

std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& dims) {
  std::vector<int64_t> s(dims.size(), 1);
  for (size_t i = dims.size(); i-- > 1;) s[i - 1] = s[i] * dims[i];
  return s;
}

RedOp ToRedOp(int64_t op) {
  switch (op) {
    case kMean: return RedOp::kMean;
    case kMax: return RedOp::kMax;
    case kMin: return RedOp::kMin;
    default: return RedOp::kSum;
  }
}

Status CheckReduceOp(Collective op, const CollectiveCall& c, int64_t max_op) {
  const int64_t r = c.attrs[0];
  if (r < kSum || r > max_op) {
    return InvalidCall(op, "reduce_op must be in [0, " + std::to_string(max_op) +
                           "] (0 sum, 1 mean, 2 max, 3 min), got " + std::to_string(r));
  }
  if (r == kMean && c.type == ElemType::kS32) {
    return InvalidCall(op, "mean of int32 is not an int32 (divide the sum instead)");
  }
  return Status{};
}

Status CheckAxis(Collective op, const std::vector<int64_t>& dims, int64_t axis,
                 const char* what) {
  if (axis < 0 || axis >= static_cast<int64_t>(dims.size())) {
    return InvalidCall(op, std::string(what) + " " + std::to_string(axis) +
                           " out of range for shape " + ShapeString(dims));
  }
  return Status{};
}

Status CheckDivisible(Collective op, const std::vector<int64_t>& dims, int64_t axis, int64_t n) {
  if (dims[axis] % n != 0) {
    return InvalidCall(op, "dimension " + std::to_string(axis) + " of shape " + ShapeString(dims) +
                           " is not divisible by the group size " + std::to_string(n));
  }
  return Status{};
}

Status CheckOutShape(Collective op, const CollectiveCall& c, const std::vector<int64_t>& want) {
  if (c.out_dims != want) {
    return InvalidCall(op, "output shape " + ShapeString(c.out_dims) + " should be " +
                           ShapeString(want));
  }
  return Status{};
}

}  // namespace

Status InvalidCall(Collective op, const std::string& what) {
  return Status{Code::kInvalidArgument, std::string("trainspec ") + CollectiveName(op) + ": " +
                                            what};
}

size_t Count(const std::vector<int64_t>& dims) { return Product(dims, 0, dims.size()); }

Status AllReduce::Prepare(const CollectiveCall& c) {
  if (Status s = CheckReduceOp(kOp, c, kMin); !s.ok()) return s;
  if (Status s = CheckOutShape(kOp, c, c.in_dims); !s.ok()) return s;
  type = c.type;
  op = ToRedOp(c.attrs[0]);
  count = Count(c.in_dims);
  const size_t elem = ElemBytes(type);
  unit = UnitElems(count, c.group_size, elem);
  units = (count + unit - 1) / unit;
  stream = count * elem >= kStreamBytes;
  written_bytes = count * elem * c.group_size;
  return Status{};
}

void AllReduce::Unit(const Peers& p, size_t u) const {
  const size_t lo = u * unit;
  ReduceInto(type, op, p.in, lo, p.n, p.out, lo, p.n, std::min(count, lo + unit) - lo, stream);
}

Status ReduceScatter::Prepare(const CollectiveCall& c) {
  if (Status s = CheckReduceOp(kOp, c, kMean); !s.ok()) return s;
  const int64_t d = c.attrs[1];
  if (Status s = CheckAxis(kOp, c.in_dims, d, "scatter_dimension"); !s.ok()) return s;
  if (Status s = CheckDivisible(kOp, c.in_dims, d, c.group_size); !s.ok()) return s;
  std::vector<int64_t> want = c.in_dims;
  want[d] /= c.group_size;
  if (Status s = CheckOutShape(kOp, c, want); !s.ok()) return s;
  type = c.type;
  op = ToRedOp(c.attrs[0]);
  outer = Product(c.in_dims, 0, d);
  dim = c.in_dims[d];
  inner = Product(c.in_dims, d + 1, c.in_dims.size());
  row = dim / c.group_size * inner;  // one member's part of one outer row
  const size_t elem = ElemBytes(type);
  piece = outer == 1 ? UnitElems(c.group_size * row, c.group_size, elem) : row;
  pieces = outer == 1 && row > 0 ? (row + piece - 1) / piece : 1;
  units = row == 0 ? 0 : c.group_size * pieces;
  stream = Count(want) * elem >= kStreamBytes;
  written_bytes = Count(c.in_dims) * elem;
  return Status{};
}

void ReduceScatter::Unit(const Peers& p, size_t u) const {
  const size_t b = u / pieces;
  const size_t lo = (u % pieces) * piece;
  const size_t len = std::min(row, lo + piece) - lo;
  for (size_t o = 0; o < outer; ++o) {
    ReduceInto(type, op, p.in, o * dim * inner + b * row + lo, p.n, p.out + b, o * row + lo, 1,
               len, stream);
  }
}

Status AllGather::Prepare(const CollectiveCall& c) {
  const int64_t axis = c.attrs[0];
  if (Status s = CheckAxis(kOp, c.in_dims, axis, "axis"); !s.ok()) return s;
  std::vector<int64_t> want = c.in_dims;
  want[axis] *= c.group_size;
  if (Status s = CheckOutShape(kOp, c, want); !s.ok()) return s;
  outer = Product(c.in_dims, 0, axis);
  block = Product(c.in_dims, axis, c.in_dims.size()) * ElemBytes(c.type);
  const size_t out_bytes = outer * block * c.group_size;
  stream = StreamCopies(out_bytes);
  units = c.group_size;
  written_bytes = out_bytes * c.group_size;
  return Status{};
}

void AllGather::Unit(const Peers& p, size_t r) const {
  auto* dst = static_cast<uint8_t*>(p.out[r]);
  for (size_t o = 0; o < outer; ++o) {
    for (int s = 0; s < p.n; ++s) {
      CopyOut(dst + (o * p.n + s) * block, static_cast<const uint8_t*>(p.in[s]) + o * block,
              block, stream);
    }
  }
}

Status AllToAll::Prepare(const CollectiveCall& c) {
  for (int i = 0; i < 2; ++i) {
    const char* what = i == 0 ? "split_axis" : "concat_axis";
    if (Status s = CheckAxis(kOp, c.in_dims, c.attrs[i], what); !s.ok()) return s;
  }
  split = c.attrs[0];
  concat = c.attrs[1];
  if (Status s = CheckDivisible(kOp, c.in_dims, split, c.group_size); !s.ok()) return s;
  chunk = c.in_dims;  // what one member sends to one other member
  chunk[split] /= c.group_size;
  std::vector<int64_t> want = chunk;
  want[concat] *= c.group_size;
  if (Status s = CheckOutShape(kOp, c, want); !s.ok()) return s;
  in_strides = RowMajorStrides(c.in_dims);
  out_strides = RowMajorStrides(c.out_dims);
  elem = ElemBytes(c.type);
  contiguous_from = std::max(split, concat);
  run_bytes = Product(chunk, contiguous_from, chunk.size()) * elem;
  runs = Product(chunk, 0, contiguous_from);
  stream = StreamCopies(Count(c.out_dims) * elem);
  units = c.group_size;
  written_bytes = Count(c.in_dims) * elem * c.group_size;
  return Status{};
}

void AllToAll::Unit(const Peers& p, size_t r) const {
  if (run_bytes == 0) return;
  auto* dst = static_cast<uint8_t*>(p.out[r]);
  for (int s = 0; s < p.n; ++s) {
    const auto* src = static_cast<const uint8_t*>(p.in[s]);
    const int64_t src_base = r * chunk[split] * in_strides[split];
    const int64_t dst_base = s * chunk[concat] * out_strides[concat];
    for (size_t k = 0; k < runs; ++k) {  // run k: row-major index over the outer axes
      int64_t so = src_base, dof = dst_base;
      size_t rest = k;
      for (size_t a = contiguous_from; a-- > 0;) {
        const int64_t i = static_cast<int64_t>(rest % chunk[a]);
        rest /= chunk[a];
        so += i * in_strides[a];
        dof += i * out_strides[a];
      }
      CopyOut(dst + dof * elem, src + so * elem, run_bytes, stream);
    }
  }
}

// The part of Prepare that broadcast and permute share: the output is the input's shape, and
// unit r writes the whole of member r's output.
template <Collective kOp>
Status PrepareWholeCopy(const CollectiveCall& c, WholeCopy<kOp>* policy) {
  if (Status s = CheckOutShape(kOp, c, c.in_dims); !s.ok()) return s;
  policy->bytes = Count(c.in_dims) * ElemBytes(c.type);
  policy->stream = StreamCopies(policy->bytes);
  policy->units = c.group_size;
  policy->written_bytes = policy->bytes * c.group_size;
  return Status{};
}

Status Broadcast::Prepare(const CollectiveCall& c) {
  root = c.attrs[0];
  if (root < 0 || root >= c.group_size) {
    return InvalidCall(kOp, "root " + std::to_string(root) + " out of range for group size " +
                            std::to_string(c.group_size));
  }
  return PrepareWholeCopy(c, this);
}

void Broadcast::Unit(const Peers& p, size_t r) const {
  CopyOut(p.out[r], p.in[root], bytes, stream);
}

Status Permute::Prepare(const CollectiveCall& c) {
  if (static_cast<int64_t>(c.attrs.size()) != c.group_size) {
    return InvalidCall(kOp, "sources must have one entry per rank (" +
                            std::to_string(c.group_size) + "), got " +
                            std::to_string(c.attrs.size()));
  }
  std::vector<uint8_t> used(c.group_size, 0);
  for (int64_t s : c.attrs) {
    if (s < -1 || s >= c.group_size) {
      return InvalidCall(kOp, "source rank " + std::to_string(s) + " out of range");
    }
    if (s >= 0 && used[s]++) {
      return InvalidCall(kOp, "source rank " + std::to_string(s) + " sends to two ranks");
    }
  }
  sources = c.attrs.data();
  return PrepareWholeCopy(c, this);
}

void Permute::Unit(const Peers& p, size_t r) const {
  if (bytes == 0) return;
  if (sources[r] < 0) {
    std::memset(p.out[r], 0, bytes);
  } else {
    CopyOut(p.out[r], p.in[sources[r]], bytes, stream);
  }
}

}  // namespace trainspec
