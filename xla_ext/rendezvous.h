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
// The same fact makes a duplicate rank detectable: a rank entering invocation k+1 while it
// is still waiting in invocation k is a second device claiming that rank.
//
// Nothing is kept after a meeting ends, except a bounded list of runs whose collectives
// failed, so that a member arriving after its peers gave up fails at once instead of
// waiting out its own timeout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace trainspec {

// Why a collective failed; the FFI layer maps each to an XLA FFI error code.
enum class Code {
  kOk,
  kInvalidArgument,   // bad operands or attributes, members disagree, duplicate rank
  kDeadlineExceeded,  // a member did not arrive within the timeout
};

struct Status {
  Code code = Code::kOk;
  std::string message;
  bool ok() const { return code == Code::kOk; }
};

struct MeetingKey {
  int64_t run_id;
  int64_t call_site;
  int64_t group;
};

// What the members of one meeting must agree on: named fields (dtype, shapes, attributes),
// so that a disagreement names the field that differs.
struct SignatureField {
  const char* name;
  std::vector<int64_t> values;  // compared
  const char* label;            // shown instead of the values when set (a dtype's name)
};
struct Signature {
  std::vector<SignatureField> fields;
  // "" when equal, otherwise "<field>: <ours> vs <theirs>" for the first field that differs.
  std::string Difference(const Signature& theirs) const;
};

// The buffers of all members, indexed by rank; valid while the work runs.
struct Peers {
  const void* const* in;
  void* const* out;
  int n;
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

// The work of one member's call. `run(op, peers, unit)` moves the data of one unit and must
// not fail (everything that can be checked is checked before). Every member passes an
// equivalent `op` (same signature), so whichever member's is used gives the same bytes.
struct Work {
  void (*run)(const void* op, const Peers& peers, size_t unit);
  const void* op;
  size_t units;
  Plan plan;
};

// Joins the meeting as `rank` of `group_size` with buffers `in`/`out`. On failure the message
// names the op, the call site and what went wrong (the ranks that never arrived, the field
// that differs, the rank claimed twice, the disagreeing group sizes).
Status Meet(const char* op_name, const MeetingKey& key, int rank, int group_size,
            const Signature& signature, const void* in, void* out, int64_t timeout_ms,
            const Work& work);

// Number of slots currently held (0 when no collective is in flight); for leak tests.
int64_t LiveRendezvousCount();

}  // namespace trainspec
