// The generic collective runner (see collective_ops.h and collective_policies.h): what every
// op shares -- checking the group, the signature the members must agree on, output pages, the
// rendezvous plan and the fences -- written once.
#include "collective_ops.h"

#include <string>

#include "collective_policies.h"
#include "output_pages.h"

namespace trainspec {
namespace {

// Below this many bytes written in total, the last member to arrive does all the data
// movement (one wake-up per call); above it the members work in parallel. Measured on
// 2 cores / 8 devices, see docs/xla_ext.md.
constexpr size_t kSmallTotalBytes = 256 * 1024;
// Group sizes beyond this are certainly a bug (a process has far fewer devices).
constexpr int64_t kMaxGroupSize = 4096;

const char* ElemTypeName(ElemType type) {
  switch (type) {
    case ElemType::kF32: return "float32";
    case ElemType::kF64: return "float64";
    case ElemType::kS32: return "int32";
    case ElemType::kBF16: return "bfloat16";
    case ElemType::kF16: return "float16";
  }
  return "?";
}

Status CheckGroup(Collective op, const CollectiveCall& c) {
  if (c.group_size < 1 || c.group_size > kMaxGroupSize) {
    return InvalidCall(op, "group_size must be in [1, " + std::to_string(kMaxGroupSize) +
                           "], got " + std::to_string(c.group_size));
  }
  if (c.timeout_ms < 1) {
    return InvalidCall(op, "timeout_ms must be positive, got " + std::to_string(c.timeout_ms));
  }
  if (c.key.call_site < 0) return InvalidCall(op, "call_site must be non-negative");
  if (c.rank < 0 || c.rank >= c.group_size) {
    return InvalidCall(op, "rank " + std::to_string(c.rank) + " out of range for group size " +
                           std::to_string(c.group_size));
  }
  if (c.key.group < 0) {
    return InvalidCall(op, "group id must be non-negative, got " + std::to_string(c.key.group));
  }
  const AttrNames names = CollectiveAttrs(op);
  if (names.last_is_list ? c.attrs.size() + 1 < names.count : c.attrs.size() != names.count) {
    return InvalidCall(op, "expected " + std::to_string(names.count) + " attribute values, got " +
                           std::to_string(c.attrs.size()));
  }
  const bool has_data = (c.in != nullptr || Count(c.in_dims) == 0) &&
                        (c.out != nullptr || Count(c.out_dims) == 0);
  if (!has_data) return InvalidCall(op, "buffer has no data");
  return Status{};
}

// What the members must agree on, field by field, so that a disagreement names the field.
Signature SignatureOf(Collective op, const CollectiveCall& c) {
  Signature sig;
  sig.fields.push_back({"dtype", {static_cast<int64_t>(c.type)}, ElemTypeName(c.type)});
  sig.fields.push_back({"input shape", c.in_dims, nullptr});
  sig.fields.push_back({"output shape", c.out_dims, nullptr});
  const AttrNames names = CollectiveAttrs(op);
  for (size_t i = 0; i < names.count; ++i) {
    const bool list = names.last_is_list && i + 1 == names.count;
    sig.fields.push_back({names.names[i],
                          std::vector<int64_t>(c.attrs.begin() + i,
                                               list ? c.attrs.end() : c.attrs.begin() + i + 1),
                          nullptr});
  }
  return sig;
}

template <typename Policy>
void RunUnit(const void* policy, const Peers& peers, size_t unit) {
  static_cast<const Policy*>(policy)->Unit(peers, unit);
  StoreFence();  // the unit's non-temporal stores are visible before it counts as done
}

template <typename Policy>
Status Run(const CollectiveCall& c) {
  if (Status s = CheckGroup(Policy::kOp, c); !s.ok()) return s;
  Policy policy;
  if (Status s = policy.Prepare(c); !s.ok()) return s;
  PrepareOutputPages(c.out, Count(c.out_dims) * ElemBytes(c.type));  // before anyone writes
  const Plan plan =
      policy.written_bytes <= kSmallTotalBytes ? Plan::kLastArriverForAll : Plan::kShared;
  const Work work{&RunUnit<Policy>, &policy, policy.units, plan};
  return Meet(CollectiveName(Policy::kOp), c.key, static_cast<int>(c.rank),
              static_cast<int>(c.group_size), SignatureOf(Policy::kOp, c), c.in, c.out,
              c.timeout_ms, work);
}

}  // namespace

const char* CollectiveName(Collective op) {
  switch (op) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllGather: return "all_gather";
    case Collective::kAllToAll: return "all_to_all";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kPermute: return "permute";
  }
  return "?";
}

AttrNames CollectiveAttrs(Collective op) {
  static const char* const kReduce[] = {"reduce_op"};
  static const char* const kReduceScatter[] = {"reduce_op", "scatter_dimension"};
  static const char* const kAxis[] = {"axis"};
  static const char* const kAllToAll[] = {"split_axis", "concat_axis"};
  static const char* const kRoot[] = {"root"};
  static const char* const kSources[] = {"sources"};
  switch (op) {
    case Collective::kAllReduce: return {kReduce, 1, false};
    case Collective::kReduceScatter: return {kReduceScatter, 2, false};
    case Collective::kAllGather: return {kAxis, 1, false};
    case Collective::kAllToAll: return {kAllToAll, 2, false};
    case Collective::kBroadcast: return {kRoot, 1, false};
    case Collective::kPermute: return {kSources, 1, true};
  }
  return {nullptr, 0, false};
}

size_t ElemBytes(ElemType type) {
  switch (type) {
    case ElemType::kF64: return 8;
    case ElemType::kF32:
    case ElemType::kS32: return 4;
    case ElemType::kBF16:
    case ElemType::kF16: return 2;
  }
  return 1;
}

Status RunCollective(Collective op, const CollectiveCall& call) {
  switch (op) {
    case Collective::kAllReduce: return Run<AllReduce>(call);
    case Collective::kReduceScatter: return Run<ReduceScatter>(call);
    case Collective::kAllGather: return Run<AllGather>(call);
    case Collective::kAllToAll: return Run<AllToAll>(call);
    case Collective::kBroadcast: return Run<Broadcast>(call);
    case Collective::kPermute: return Run<Permute>(call);
  }
  return InvalidCall(op, "unknown collective");
}

}  // namespace trainspec
