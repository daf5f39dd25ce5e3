// NCCL communicators of the ext collectives on CUDA: created from Python (one per group of
// devices that a collective spans, trainspec/jax/collectives/nccl.py), found by the handlers by
// their id and the device they run on, and the deadline every NCCL operation runs under.
//
// Communicators are nonblocking (NCCL's config.blocking = 0): no NCCL call waits, so the
// handler can watch the clock. WaitDone polls the communicator's asynchronous error and the
// stream until the enqueued work is done; past the deadline it aborts the communicator (a hung
// peer cannot hang this process) and returns one line naming the op and the timeout.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "nccl_api.h"

namespace trainspec {
namespace nccl {

// One local device's member of a communicator: its CUDA ordinal, its rank, the group's size and
// the group's unique id (made by ncclGetUniqueId in the process of the group's rank 0).
struct Member {
  int device;
  int rank;
  int nranks;
  UniqueId id;
};

// Creates communicator `comm_id` for every local member at once (one NCCL group: members of one
// process must join together) and waits up to timeout_ms for all of them. Empty on success,
// else one line (the communicators are aborted).
std::string Create(int64_t comm_id, const std::vector<Member>& members, int64_t timeout_ms);

struct Handle {
  Comm_t comm = nullptr;
  int rank = 0;
  int nranks = 0;
};

// The member of communicator `comm_id` on `device`; comm null if there is none.
Handle Find(int64_t comm_id, int device);

// Aborts and forgets every communicator (at exit, or after a timeout made them unusable).
void DestroyAll();

// Waits until the NCCL work enqueued on `stream` through `h` has completed, with the deadline
// timeout_ms from now. Empty on success; else one line "<op>: ..." and `h` is aborted.
std::string WaitDone(const char* op, const Handle& h, cudaStream_t stream, int64_t timeout_ms);

// A failed NCCL or CUDA call as one line, or empty on success / kInProgress (nonblocking
// communicators report the outcome later, through WaitDone).
std::string Failed(const char* what, Result r);
std::string Failed(const char* what, cudaError_t e);

}  // namespace nccl
}  // namespace trainspec
