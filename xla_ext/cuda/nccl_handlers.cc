// The ext collectives on CUDA through NCCL: all_reduce, reduce_scatter, all_gather, all_to_all,
// broadcast and permute, on XLA's stream, under the same target names and operands as the CPU
// handlers (collectives.cc) plus two attributes: `comm` (the communicator of the group, made by
// trainspec/jax/collectives/nccl.py) and, for all_reduce, `deterministic`.
//
// Deterministic reductions (reduce_scatter always, all_reduce unless deterministic = 0): every
// member sends each peer the peer's slice (grouped ncclSend/ncclRecv), reduces the n slices it
// received in rank order 0..n-1 with the shared reduction kernel (16-bit floats accumulated in
// float32, rounded once), and all_reduce then gathers the reduced slices: the CPU handlers'
// result, bit for bit, whatever NCCL's algorithm. deterministic = 0 is one ncclAllReduce.
//
// Layouts: NCCL moves contiguous ranges, so the dimension that is gathered, scattered or split
// must be the leading one (what the ext backend's compressed exchange and the train step use);
// another is refused by name. Each handler waits for its NCCL work under collectives.timeout_s
// (nccl_comms.h) and returns one line on a timeout, with the communicator aborted.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cuda_handlers.h"
#include "device_kernels.h"
#include "nccl_comms.h"

namespace ffi = xla::ffi;

namespace trainspec {
namespace {

using Stream = ffi::PlatformStream<cudaStream_t>;
enum class Op { kAllReduce, kReduceScatter, kAllGather, kAllToAll, kBroadcast, kPermute };
constexpr const char* kNames[] = {"all_reduce", "reduce_scatter", "all_gather",
                                  "all_to_all", "broadcast",      "permute"};

// One member's decoded call.
struct Call {
  const char* name;
  nccl::Handle h;
  nccl::DataType type;
  ElemType elem;
  size_t elem_bytes;
  size_t count;  // input elements
  size_t out_count;
  std::vector<int64_t> dims;
  int64_t timeout_ms;
  const char* in;
  char* out;
};

ffi::Error Invalid(const char* name, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("trainspec ") + name + " (CUDA): " + what);
}

ffi::Error FromLine(const std::string& line) {
  return line.empty() ? ffi::Error::Success() : ffi::Error::Internal("trainspec " + line);
}

bool ToTypes(ffi::DataType d, nccl::DataType* t, ElemType* e, size_t* bytes) {
  switch (d) {
    case ffi::DataType::F32: *t = nccl::kFloat32, *e = ElemType::kF32, *bytes = 4; return true;
    case ffi::DataType::F64: *t = nccl::kFloat64, *e = ElemType::kF64, *bytes = 8; return true;
    case ffi::DataType::S32: *t = nccl::kInt32, *e = ElemType::kS32, *bytes = 4; return true;
    case ffi::DataType::BF16: *t = nccl::kBfloat16, *e = ElemType::kBF16, *bytes = 2; return true;
    case ffi::DataType::F16: *t = nccl::kFloat16, *e = ElemType::kF16, *bytes = 2; return true;
    default: return false;
  }
}

ffi::ErrorOr<int64_t> Attr(const char* name, const ffi::Dictionary& attrs, const char* attr) {
  ffi::ErrorOr<int64_t> v = attrs.get<int64_t>(attr);
  if (v.has_error()) {
    return ffi::Unexpected(Invalid(name, std::string("attribute ") + attr + " (int64) is missing"));
  }
  return v;
}

ffi::Error Decode(Op op, cudaStream_t stream, const ffi::AnyBuffer& x, const ffi::AnyBuffer& out,
                  const ffi::Dictionary& attrs, Call* c) {
  c->name = kNames[static_cast<int>(op)];
  if (nccl::Loaded() == nullptr) {
    return Invalid(c->name, "NCCL is not loaded (trainspec.jax.collectives.nccl loads it)");
  }
  if (!ToTypes(x.element_type(), &c->type, &c->elem, &c->elem_bytes)) {
    return Invalid(c->name, "unsupported dtype (supported: float32, bfloat16, float16, float64, "
                            "int32)");
  }
  if (out.element_type() != x.element_type()) {
    return Invalid(c->name, "output dtype differs from input dtype");
  }
  int64_t values[3];
  const char* const kCommon[] = {"comm", "group_size", "timeout_ms"};
  for (int i = 0; i < 3; ++i) {
    ffi::ErrorOr<int64_t> v = Attr(c->name, attrs, kCommon[i]);
    if (v.has_error()) return v.error();
    values[i] = *v;
  }
  int device = -1;
  if (cudaStreamGetDevice(stream, &device) != cudaSuccess) {
    return Invalid(c->name, "cannot tell the stream's device");
  }
  c->h = nccl::Find(values[0], device);
  if (c->h.comm == nullptr) {
    return Invalid(c->name, "no NCCL communicator " + std::to_string(values[0]) + " on device " +
                                std::to_string(device) +
                                " (made by trainspec.jax.collectives.nccl)");
  }
  if (values[1] != c->h.nranks) {
    return Invalid(c->name, "group_size " + std::to_string(values[1]) + " but the communicator "
                            "has " + std::to_string(c->h.nranks) + " ranks");
  }
  c->timeout_ms = values[2] > 0 ? values[2] : 1;
  c->count = x.element_count();
  c->out_count = out.element_count();
  c->dims.assign(x.dimensions().begin(), x.dimensions().end());
  c->in = static_cast<const char*>(x.untyped_data());
  c->out = static_cast<char*>(out.untyped_data());
  if ((c->count > 0 && c->in == nullptr) || (out.element_count() > 0 && c->out == nullptr)) {
    return Invalid(c->name, "a buffer has no data");
  }
  return ffi::Error::Success();
}

// The output's element count: `times` x (or, with `divide`, 1 / `times` of) the input's.
ffi::Error OutputCount(const Call& c, size_t times, bool divide) {
  const size_t want = divide ? c.count / times : c.count * times;
  if (c.out_count != want) {
    return Invalid(c.name, "output has " + std::to_string(c.out_count) + " elements, expected " +
                               std::to_string(want));
  }
  return ffi::Error::Success();
}

// The gathered, scattered or split dimension (attribute `attr`) must be the leading one.
ffi::Error Leading(const Call& c, int64_t axis, const char* attr) {
  if (axis != 0) {
    return Invalid(c.name, std::string(attr) + " must be 0 on CUDA (NCCL moves contiguous "
                                               "blocks), got " + std::to_string(axis));
  }
  return ffi::Error::Success();
}

// ... and split into `n` equal blocks.
ffi::Error LeadingBlocks(const Call& c, int64_t axis, const char* attr) {
  if (ffi::Error e = Leading(c, axis, attr); e.failure()) return e;
  if (c.dims.empty() || c.dims[0] % c.h.nranks != 0) {
    return Invalid(c.name, "the leading dimension must be divisible by the group size " +
                               std::to_string(c.h.nranks));
  }
  return ffi::Error::Success();
}

// NCCL work enqueued as one group: wait until it is enqueued (nonblocking communicators).
std::string Grouped(const Call& c, const std::string& enqueue_error) {
  const std::string end = nccl::Failed("ncclGroupEnd", nccl::Loaded()->GroupEnd());
  const std::string error = enqueue_error.empty() ? end : enqueue_error;
  if (!error.empty()) return c.name + (": " + error);
  return nccl::WaitDone(c.name, c.h, nullptr, c.timeout_ms);
}

// The slice of rank r: [start, start + len) of `count` elements cut into nranks slices of
// ceil(count / nranks) (the last ones shorter or empty).
struct Slice {
  size_t start, len;
};
Slice SliceOf(size_t count, int nranks, int r) {
  const size_t chunk = (count + nranks - 1) / nranks;
  const size_t start = std::min(count, chunk * r);
  return Slice{start, std::min(chunk, count - start)};
}

// Phase 1 of the deterministic reductions: this member's slice, reduced in rank order, into
// `dst`. `rows` is scratch for nranks slices.
std::string ReduceMySlice(const Call& c, RedOp op, char* rows, char* dst, cudaStream_t s) {
  const nccl::Api* api = nccl::Loaded();
  const Slice mine = SliceOf(c.count, c.h.nranks, c.h.rank);
  std::string error = nccl::Failed("ncclGroupStart", api->GroupStart());
  for (int p = 0; p < c.h.nranks && error.empty(); ++p) {
    const Slice theirs = SliceOf(c.count, c.h.nranks, p);
    error = nccl::Failed("ncclSend", api->Send(c.in + theirs.start * c.elem_bytes, theirs.len,
                                               c.type, p, c.h.comm, s));
    if (error.empty()) {
      error = nccl::Failed("ncclRecv", api->Recv(rows + p * mine.len * c.elem_bytes, mine.len,
                                                 c.type, p, c.h.comm, s));
    }
  }
  if (error = Grouped(c, error); !error.empty()) return error;
  return nccl::Failed("reduction kernel",
                      cuda::LaunchReduceRows(c.elem, op, rows, c.h.nranks, mine.len, dst, s));
}

RedOp ToRedOp(int64_t r) {
  return r == 1 ? RedOp::kMean : r == 2 ? RedOp::kMax : r == 3 ? RedOp::kMin : RedOp::kSum;
}

ffi::Error CheckReduceOp(const Call& c, int64_t r) {
  if (r < 0 || r > 3) {
    return Invalid(c.name, "reduce_op must be in [0, 3] (0 sum, 1 mean, 2 max, 3 min), got " +
                               std::to_string(r));
  }
  if (r == 1 && c.elem == ElemType::kS32) {
    return Invalid(c.name, "mean of int32 is not an int32 (divide the sum instead)");
  }
  return ffi::Error::Success();
}

std::optional<char*> Scratch(ffi::ScratchAllocator& scratch, size_t bytes) {
  std::optional<void*> p = scratch.Allocate(bytes == 0 ? 1 : bytes, 256);
  if (!p.has_value()) return std::nullopt;
  return static_cast<char*>(*p);
}

// Runs the op's NCCL work and waits for it; the decoded call `c` is valid.
std::string Run(Op op, const Call& c, const ffi::Dictionary& attrs, ffi::ScratchAllocator& scratch,
                cudaStream_t s, ffi::Error* invalid) {
  const nccl::Api* api = nccl::Loaded();
  const int n = c.h.nranks;
  auto attr = [&](const char* name) -> int64_t {
    ffi::ErrorOr<int64_t> v = Attr(c.name, attrs, name);
    if (v.has_error() && invalid->success()) *invalid = v.error();
    return v.has_error() ? 0 : *v;
  };
  const bool scatters = op == Op::kReduceScatter;
  if (*invalid = OutputCount(c, scatters || op == Op::kAllGather ? n : 1, scatters);
      !invalid->success()) {
    return "";
  }
  std::string error;
  switch (op) {
    case Op::kAllReduce:
    case Op::kReduceScatter: {
      const int64_t r = attr("reduce_op");
      const bool deterministic = op == Op::kReduceScatter || attr("deterministic") != 0;
      if (!invalid->success()) return "";
      if (*invalid = CheckReduceOp(c, r); !invalid->success()) return "";
      if (op == Op::kReduceScatter) {
        if (*invalid = LeadingBlocks(c, attr("scatter_dimension"), "scatter_dimension");
            !invalid->success()) {
          return "";
        }
      }
      if (!deterministic) {
        const nccl::RedOp nop = r == 1 ? nccl::kAvg : r == 2 ? nccl::kMax
                                                             : r == 3 ? nccl::kMin : nccl::kSum;
        error = nccl::Failed("ncclAllReduce",
                             api->AllReduce(c.in, c.out, c.count, c.type, nop, c.h.comm, s));
        break;
      }
      const Slice mine = SliceOf(c.count, n, c.h.rank);
      const bool gather = op == Op::kAllReduce;
      const size_t slices = n + (gather ? 1 : 0);
      std::optional<char*> rows = Scratch(scratch, slices * mine.len * c.elem_bytes);
      if (!rows) {
        return std::string(c.name) + ": no scratch memory for " + std::to_string(slices) +
               " slices";
      }
      char* reduced = gather ? *rows + n * mine.len * c.elem_bytes : c.out;
      if (error = ReduceMySlice(c, ToRedOp(r), *rows, reduced, s); !error.empty() || !gather) break;
      error = nccl::Failed("ncclGroupStart", api->GroupStart());
      for (int p = 0; p < n && error.empty(); ++p) {
        const Slice theirs = SliceOf(c.count, n, p);
        error = nccl::Failed("ncclSend", api->Send(reduced, mine.len, c.type, p, c.h.comm, s));
        if (error.empty()) {
          error = nccl::Failed("ncclRecv", api->Recv(c.out + theirs.start * c.elem_bytes,
                                                     theirs.len, c.type, p, c.h.comm, s));
        }
      }
      error = Grouped(c, error);
      break;
    }
    case Op::kAllGather:
      if (*invalid = Leading(c, attr("axis"), "axis"); !invalid->success()) return "";
      error = nccl::Failed("ncclAllGather",
                           api->AllGather(c.in, c.out, c.count, c.type, c.h.comm, s));
      break;
    case Op::kAllToAll: {
      if (*invalid = LeadingBlocks(c, attr("split_axis"), "split_axis"); !invalid->success()) {
        return "";
      }
      if (*invalid = LeadingBlocks(c, attr("concat_axis"), "concat_axis"); !invalid->success()) {
        return "";
      }
      const size_t block = c.count / n * c.elem_bytes;
      error = nccl::Failed("ncclGroupStart", api->GroupStart());
      for (int p = 0; p < n && error.empty(); ++p) {
        error = nccl::Failed("ncclSend", api->Send(c.in + p * block, c.count / n, c.type, p,
                                                   c.h.comm, s));
        if (error.empty()) {
          error = nccl::Failed("ncclRecv", api->Recv(c.out + p * block, c.count / n, c.type, p,
                                                     c.h.comm, s));
        }
      }
      error = Grouped(c, error);
      break;
    }
    case Op::kBroadcast: {
      const int64_t root = attr("root");
      if (!invalid->success()) return "";
      if (root < 0 || root >= n) {
        *invalid = Invalid(c.name, "root " + std::to_string(root) + " out of range for group "
                                   "size " + std::to_string(n));
        return "";
      }
      error = nccl::Failed("ncclBroadcast", api->Broadcast(c.in, c.out, c.count, c.type,
                                                           static_cast<int>(root), c.h.comm, s));
      break;
    }
    case Op::kPermute: {
      auto sources = attrs.get<ffi::Span<const int64_t>>("sources");
      if (sources.has_error() || static_cast<int>(sources->size()) != n) {
        *invalid = Invalid(c.name, "attribute sources must list one source rank per rank (" +
                                       std::to_string(n) + ")");
        return "";
      }
      const int64_t* src = sources->begin();
      for (int d = 0; d < n; ++d) {
        if (src[d] < -1 || src[d] >= n) {
          *invalid = Invalid(c.name, "source rank " + std::to_string(src[d]) + " out of range");
          return "";
        }
      }
      const size_t bytes = c.count * c.elem_bytes;
      if (src[c.h.rank] < 0) error = nccl::Failed("zeroing", cudaMemsetAsync(c.out, 0, bytes, s));
      if (!error.empty()) break;
      error = nccl::Failed("ncclGroupStart", api->GroupStart());
      for (int d = 0; d < n && error.empty(); ++d) {
        if (src[d] == c.h.rank) {
          error = nccl::Failed("ncclSend", api->Send(c.in, c.count, c.type, d, c.h.comm, s));
        }
      }
      if (error.empty() && src[c.h.rank] >= 0) {
        error = nccl::Failed("ncclRecv", api->Recv(c.out, c.count, c.type,
                                                   static_cast<int>(src[c.h.rank]), c.h.comm, s));
      }
      error = Grouped(c, error);
      break;
    }
  }
  if (!error.empty()) return error.rfind(c.name, 0) == 0 ? error : c.name + (": " + error);
  return nccl::WaitDone(c.name, c.h, s, c.timeout_ms);
}

template <Op kOp>
ffi::Error Handle(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                  ffi::AnyBuffer /*rank*/, ffi::AnyBuffer /*group*/,
                  ffi::Result<ffi::AnyBuffer> out, ffi::Dictionary attrs) {
  Call c;
  if (ffi::Error e = Decode(kOp, stream, x, *out, attrs, &c); e.failure()) return e;
  ffi::Error invalid = ffi::Error::Success();
  const std::string error = Run(kOp, c, attrs, scratch, stream, &invalid);
  return invalid.failure() ? invalid : FromLine(error);
}

auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<Stream>()
      .Ctx<ffi::ScratchAllocator>()
      .Arg<ffi::AnyBuffer>()  // x
      .Arg<ffi::AnyBuffer>()  // rank (the CPU handlers' operand; NCCL knows the rank)
      .Arg<ffi::AnyBuffer>()  // group (likewise: the communicator is the group)
      .Ret<ffi::AnyBuffer>()
      .Attrs<ffi::Dictionary>();  // comm, group_size, timeout_ms, call_site and the op's own
}

}  // namespace
}  // namespace trainspec

using trainspec::Op;
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecAllReduceCuda, trainspec::Handle<Op::kAllReduce>,
                              trainspec::Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecReduceScatterCuda, trainspec::Handle<Op::kReduceScatter>,
                              trainspec::Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecAllGatherCuda, trainspec::Handle<Op::kAllGather>,
                              trainspec::Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecAllToAllCuda, trainspec::Handle<Op::kAllToAll>,
                              trainspec::Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecBroadcastCuda, trainspec::Handle<Op::kBroadcast>,
                              trainspec::Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecPermuteCuda, trainspec::Handle<Op::kPermute>,
                              trainspec::Binding());
