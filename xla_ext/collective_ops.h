// The six collectives on plain buffers, independent of XLA: one generic runner plus a small
// policy per op (collective_ops.cc). collectives.cc binds them to XLA FFI handlers; the C++
// harness (tests/cxx/harness.cc) calls them directly from threads.
//
// A call is one member's view: its rank in a group of `group_size`, its input and output
// buffers, and the op's attributes. Members meet through rendezvous.h, then read each
// other's inputs and write outputs directly (no staging copy).
//
// Determinism: every reduction combines the members' values in rank order 0, 1, ..., n-1,
// whoever computes it and whichever member arrived first, so results are bitwise identical
// run to run. bf16/f16 are accumulated in float32 and rounded once (round to nearest even).
// The work is cut into units whose bytes depend only on the shapes; who runs a unit never
// changes its result. max/min propagate NaN, like jnp.maximum/jnp.minimum.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "reduce_kernels.h"
#include "rendezvous.h"

namespace trainspec {

enum class Collective { kAllReduce, kReduceScatter, kAllGather, kAllToAll, kBroadcast, kPermute };

// Reduce ops as the "reduce_op" attribute numbers them (trainspec/jax/collectives/ext.py).
enum ReduceOpAttr : int64_t { kSum = 0, kMean = 1, kMax = 2, kMin = 3 };

// The op's attribute names, in the order CollectiveCall::attrs holds their values. Scalars
// hold one value each; a list attribute (only permute's "sources", one entry per rank) is
// last and holds the rest.
struct AttrNames {
  const char* const* names;
  size_t count;
  bool last_is_list;
};

const char* CollectiveName(Collective op);
AttrNames CollectiveAttrs(Collective op);

struct CollectiveCall {
  MeetingKey key;
  int64_t rank;
  int64_t group_size;
  int64_t timeout_ms;
  ElemType type;
  std::vector<int64_t> in_dims;
  std::vector<int64_t> out_dims;
  const void* in;
  void* out;
  std::vector<int64_t> attrs;
};

size_t ElemBytes(ElemType type);

// A kInvalidArgument status "trainspec <op>: <what>".
Status InvalidCall(Collective op, const std::string& what);

// Checks the call (everything one member can check alone), meets the other members and moves
// the data. Never crashes on bad input: it returns kInvalidArgument naming what is wrong.
Status RunCollective(Collective op, const CollectiveCall& call);

}  // namespace trainspec
