// In-process rendezvous for the xla_ext collectives.
//
// Under jit(shard_map(...)) on CPU every simulated device runs the same program on its own
// thread, so a collective is a meeting of `n` threads of one process: each member publishes
// its input and output buffers, the members do the data movement directly between each
// other's buffers, and nobody returns before the others are done with its buffers.
//
// A meeting is identified by
//   (run id, call site, group)  -- the Slot: run id separates concurrent executions, the call
//                                  site (a per-trace static attribute) separates collectives
//                                  of one program, the group separates rows/columns of a mesh;
//   invocation index            -- how many times this member has entered the slot before, so
//                                  the same call site inside scan/fori_loop/while pairs the
//                                  k-th call of every member with the k-th call of the others.
// The invocation counters live in the Slot, which exists only while a member is inside it:
// once every member has left, the Slot is freed and a later entry starts again from zero,
// which is consistent because all members left the same number of times (no member can be
// more than one invocation ahead: it cannot leave invocation k before all joined it).
//
// Nothing is kept after a meeting ends, except a bounded list of runs whose collectives
// failed, so that a member arriving after its peers gave up fails at once instead of
// waiting out its own timeout.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace trainspec {

struct MeetingKey {
  int64_t run_id;
  int64_t call_site;
  int64_t group;
};

// What a member contributes: its buffers, and what the others must agree on.
struct Member {
  const void* in;
  void* out;
};

struct Signature {
  int dtype;
  std::vector<int64_t> in_dims;
  std::vector<int64_t> out_dims;
  std::vector<int64_t> params;  // op-specific attributes (reduce op, axes, root, ...)
  bool operator==(const Signature& o) const {
    return dtype == o.dtype && in_dims == o.in_dims && out_dims == o.out_dims &&
           params == o.params;
  }
  bool operator!=(const Signature& o) const { return !(*this == o); }
};

// How the data movement is divided among the members once all have arrived. The work is cut
// into `units` independent pieces (which piece writes which bytes is fixed by the op, never by
// who runs it, so results do not depend on scheduling).
enum class Plan {
  // The last member to arrive does every unit, then releases the others: one wake-up per
  // meeting, best when the data is small and synchronisation dominates.
  kLastArriverForAll,
  // The last member wakes the others and every member takes units from a shared counter until
  // none is left, then all wait until all units are done (a member's buffers may still be in
  // use by the others). Members that are running do the work: on a machine with fewer cores
  // than devices, a member that is not scheduled does not hold up a fixed share.
  kShared,
};

// `share(members, unit)` moves the data of one unit; members[r] are the buffers of rank r. It
// must not fail: everything that can be checked is checked before.
using Share = std::function<void(const std::vector<Member>& members, size_t unit)>;

// Joins the meeting as `rank` of `group_size`; returns "" on success, otherwise a message
// that names the op, the call site and (on timeout) the ranks that never arrived.
std::string Meet(const char* op_name, const MeetingKey& key, int rank, int group_size,
                 const Signature& signature, Member self, int64_t timeout_ms, Plan plan,
                 size_t units, const Share& share);

// Number of slots currently held (0 when no collective is in flight); for leak tests.
int64_t LiveRendezvousCount();

}  // namespace trainspec
