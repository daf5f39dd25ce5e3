// The collectives as XLA FFI handlers for the CPU backend: all_reduce, reduce_scatter,
// all_gather, all_to_all, broadcast and permute between the devices of one process.
//
// Every handler takes (x, rank, group) and returns one buffer. `rank` and `group` are int32
// scalars that trainspec/jax/collectives/ext.py computes with lax.axis_index, so a group can be any
// subset of mesh axes (a row, a column) without the handler knowing device ids; the group
// size, the call site, the timeout and the op's own attributes are static attributes. This
// file only translates between XLA FFI and collective_ops.h, once for all six ops.
#include <string>

#include "collective_ops.h"
#include "handlers.h"

namespace ffi = xla::ffi;

namespace trainspec {
namespace {

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

ffi::Error ToFfiError(const Status& s) {
  switch (s.code) {
    case Code::kOk: return ffi::Error::Success();
    case Code::kInvalidArgument: return ffi::Error::InvalidArgument(s.message);
    case Code::kDeadlineExceeded: return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, s.message);
  }
  return ffi::Error::Internal(s.message);
}

ffi::Error Invalid(Collective op, const std::string& what) {
  return ToFfiError(InvalidCall(op, what));
}

ffi::ErrorOr<int64_t> Int64Attr(Collective op, const ffi::Dictionary& attrs, const char* name) {
  ffi::ErrorOr<int64_t> v = attrs.get<int64_t>(name);
  if (v.has_error()) return ffi::Unexpected(Invalid(op, std::string("attribute ") + name +
                                                           " (int64) is missing"));
  return v;
}

// Reads one member's call out of the FFI operands; the checks that do not depend on XLA's
// representation are RunCollective's.
ffi::Error Decode(Collective op, ffi::RunId run_id, const ffi::AnyBuffer& x,
                  const ffi::AnyBuffer& rank, const ffi::AnyBuffer& group,
                  const ffi::AnyBuffer& out, const ffi::Dictionary& attrs, CollectiveCall* c) {
  for (const ffi::AnyBuffer* b : {&rank, &group}) {
    if (b->element_type() != ffi::DataType::S32 || b->element_count() != 1 ||
        b->untyped_data() == nullptr) {
      return Invalid(op, "rank and group must be int32 scalars");
    }
  }
  if (!ToElemType(x.element_type(), &c->type)) {
    return Invalid(op, "unsupported dtype (supported: float32, bfloat16, float16, float64, int32)");
  }
  if (out.element_type() != x.element_type()) {
    return Invalid(op, "output dtype differs from input dtype");
  }
  int64_t common[3];
  const char* const kCommon[] = {"call_site", "group_size", "timeout_ms"};
  for (int i = 0; i < 3; ++i) {
    ffi::ErrorOr<int64_t> v = Int64Attr(op, attrs, kCommon[i]);
    if (v.has_error()) return v.error();
    common[i] = *v;
  }
  const AttrNames names = CollectiveAttrs(op);
  if (attrs.size() != 3 + names.count) {
    return Invalid(op, "expected " + std::to_string(3 + names.count) + " attributes, got " +
                           std::to_string(attrs.size()));
  }
  c->attrs.clear();
  for (size_t i = 0; i < names.count; ++i) {
    if (names.last_is_list && i + 1 == names.count) {
      auto list = attrs.get<ffi::Span<const int64_t>>(names.names[i]);
      if (list.has_error()) {
        return Invalid(op, std::string("attribute ") + names.names[i] +
                               " (int64 array) is missing");
      }
      c->attrs.insert(c->attrs.end(), list->begin(), list->end());
    } else {
      ffi::ErrorOr<int64_t> v = Int64Attr(op, attrs, names.names[i]);
      if (v.has_error()) return v.error();
      c->attrs.push_back(*v);
    }
  }
  c->key = MeetingKey{run_id.run_id, common[0], *static_cast<const int32_t*>(group.untyped_data())};
  c->rank = *static_cast<const int32_t*>(rank.untyped_data());
  c->group_size = common[1];
  c->timeout_ms = common[2];
  c->in_dims.assign(x.dimensions().begin(), x.dimensions().end());
  c->out_dims.assign(out.dimensions().begin(), out.dimensions().end());
  c->in = x.untyped_data();
  c->out = out.untyped_data();
  return ffi::Error::Success();
}

// The one handler body of every collective.
template <Collective kOp>
ffi::Error Handle(ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer rank, ffi::AnyBuffer group,
                  ffi::Result<ffi::AnyBuffer> out, ffi::Dictionary attrs) {
  CollectiveCall call;
  if (ffi::Error e = Decode(kOp, run_id, x, rank, group, *out, attrs, &call); e.failure()) {
    return e;
  }
  return ToFfiError(RunCollective(kOp, call));
}

auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::RunId>()
      .Arg<ffi::AnyBuffer>()  // x
      .Arg<ffi::AnyBuffer>()  // rank
      .Arg<ffi::AnyBuffer>()  // group
      .Ret<ffi::AnyBuffer>()
      .Attrs<ffi::Dictionary>();  // call_site, group_size, timeout_ms and the op's own
}

}  // namespace
}  // namespace trainspec

using trainspec::Collective;
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecAllReduce, trainspec::Handle<Collective::kAllReduce>,
                              trainspec::Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecReduceScatter,
                              trainspec::Handle<Collective::kReduceScatter>, trainspec::Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecAllGather, trainspec::Handle<Collective::kAllGather>,
                              trainspec::Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecAllToAll, trainspec::Handle<Collective::kAllToAll>,
                              trainspec::Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecBroadcast, trainspec::Handle<Collective::kBroadcast>,
                              trainspec::Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainspecPermute, trainspec::Handle<Collective::kPermute>,
                              trainspec::Binding());
