// The per-op policies of the collective runner (collective_ops.cc), after Horovod's
// CollectiveOp family (horovod/common/ops/collective_operations.h): a policy knows only what
// differs between ops.
//   Prepare(call)  checks what one member can check alone (attributes, shapes) and fixes how
//                  the work is cut: `units`, and `written_bytes` (all members' outputs
//                  together), which chooses the plan;
//   Unit(peers, u) moves the bytes of unit u between the members' buffers; which bytes a
//                  unit writes depends only on the shapes, never on the member running it.
// Checking the group, the signature the members must agree on, output pages, the rendezvous
// and the fences are the runner's, once for all ops.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "collective_ops.h"

namespace trainspec {

// Number of elements of an array with these dimensions.
size_t Count(const std::vector<int64_t>& dims);

template <Collective kCollective>
struct PolicyBase {
  static constexpr Collective kOp = kCollective;
  size_t units = 0;
  size_t written_bytes = 0;
};

// What the two reductions share.
template <Collective kCollective>
struct Reduction : PolicyBase<kCollective> {
  ElemType type;
  RedOp op;
  bool stream;  // non-temporal stores
};

// What the ops that copy a member's whole input share.
template <Collective kCollective>
struct WholeCopy : PolicyBase<kCollective> {
  size_t bytes;
  bool stream;
};

// Unit u reduces elements [u * unit, (u + 1) * unit) of all inputs (rank order) and writes
// them into every member's output: reduce-scatter and all-gather in one pass, reading each
// input once and writing each output once, with no staging buffer.
// It is safe in place (each member's output its own input: api.all_reduce's in_place): a unit
// loads every input's elements of a 128-byte step before storing that step anywhere, units
// cover disjoint ranges, and no member returns before every unit is done.
struct AllReduce : Reduction<Collective::kAllReduce> {
  Status Prepare(const CollectiveCall& c);
  void Unit(const Peers& p, size_t u) const;
  size_t count, unit;
};

// Block b of every input is reduced straight into member b's output: each input byte is read
// once and each output byte written once. With the scatter dimension leading (outer == 1) a
// block is one contiguous run, cut into pieces so that units stay small; otherwise a unit is
// one member's block in every outer row.
struct ReduceScatter : Reduction<Collective::kReduceScatter> {
  Status Prepare(const CollectiveCall& c);
  void Unit(const Peers& p, size_t u) const;
  size_t outer, dim, inner, row, piece, pieces;
};

// Unit r fills member r's output: every member's block, in rank order, in every outer row.
struct AllGather : PolicyBase<Collective::kAllGather> {
  Status Prepare(const CollectiveCall& c);
  void Unit(const Peers& p, size_t r) const;
  size_t outer, block;
  bool stream;
};

// Unit r fills member r's output with chunk r of every member's input. From the later of the
// split and concat axes on, both a chunk and its destination are contiguous runs.
struct AllToAll : PolicyBase<Collective::kAllToAll> {
  Status Prepare(const CollectiveCall& c);
  void Unit(const Peers& p, size_t r) const;
  std::vector<int64_t> chunk, in_strides, out_strides;
  size_t split, concat, contiguous_from, run_bytes, runs, elem;
  bool stream;
};

// Unit r copies the root's input into member r's output.
struct Broadcast : WholeCopy<Collective::kBroadcast> {
  Status Prepare(const CollectiveCall& c);
  void Unit(const Peers& p, size_t r) const;
  int64_t root;
};

// Unit r copies the input of member sources[r] into member r's output (zeros for -1, like
// lax.ppermute for ranks nobody sends to).
struct Permute : WholeCopy<Collective::kPermute> {
  Status Prepare(const CollectiveCall& c);
  void Unit(const Peers& p, size_t r) const;
  const int64_t* sources;  // the call's attrs, alive while the call runs
};

}  // namespace trainspec
