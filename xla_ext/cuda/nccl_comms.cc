// NCCL communicators and deadlines (nccl_comms.h).
#include "nccl_comms.h"

#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

namespace trainspec {
namespace nccl {
namespace {

std::mutex registry_mutex;
std::map<std::pair<int64_t, int>, Handle> registry;  // (comm id, device) -> member

using Clock = std::chrono::steady_clock;

// Polls until every communicator's async state is no longer kInProgress (and, with a stream,
// the stream is idle). Empty on success, else the line that says why not.
std::string Poll(const char* op, const std::vector<Comm_t>& comms, cudaStream_t stream,
                 int64_t timeout_ms) {
  const Api* api = Loaded();
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  auto pause = std::chrono::microseconds(20);
  while (true) {
    bool pending = false;
    for (Comm_t c : comms) {
      Result r = kSuccess;
      if (Result q = api->CommGetAsyncError(c, &r); q != kSuccess) r = q;
      if (r == kInProgress) {
        pending = true;
      } else if (r != kSuccess) {
        return std::string(op) + ": NCCL reported " + api->GetErrorString(r);
      }
    }
    if (!pending && stream != nullptr) {
      const cudaError_t e = cudaStreamQuery(stream);
      if (e == cudaErrorNotReady) {
        pending = true;
      } else if (e != cudaSuccess) {
        return std::string(op) + ": CUDA reported " + cudaGetErrorString(e);
      }
    }
    if (!pending) return "";
    if (Clock::now() > deadline) {
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%g", timeout_ms / 1000.0);
      return std::string(op) + ": not done after collectives.timeout_s = " + seconds +
             " s (a member missing or hung); the NCCL communicator was aborted";
    }
    std::this_thread::sleep_for(pause);
    if (pause < std::chrono::milliseconds(1)) pause *= 2;
  }
}

}  // namespace

std::string Failed(const char* what, Result r) {
  if (r == kSuccess || r == kInProgress) return "";
  return std::string(what) + ": " + Loaded()->GetErrorString(r);
}

std::string Failed(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return "";
  return std::string(what) + ": " + cudaGetErrorString(e);
}

std::string Create(int64_t comm_id, const std::vector<Member>& members, int64_t timeout_ms) {
  const Api* api = Loaded();
  if (api == nullptr) return "NCCL is not loaded";
  std::vector<Comm_t> comms(members.size(), nullptr);
  std::string error = Failed("ncclGroupStart", api->GroupStart());
  for (size_t i = 0; i < members.size() && error.empty(); ++i) {
    const Member& m = members[i];
    Config config;
    config.blocking = 0;
    error = Failed("cudaSetDevice", cudaSetDevice(m.device));
    if (error.empty()) {
      error = Failed("ncclCommInitRankConfig",
                     api->CommInitRankConfig(&comms[i], m.nranks, m.id, m.rank, &config));
    }
  }
  if (const std::string end = Failed("ncclGroupEnd", api->GroupEnd()); error.empty()) error = end;
  if (error.empty()) error = Poll("NCCL communicator setup", comms, nullptr, timeout_ms);
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (size_t i = 0; i < members.size(); ++i) {
    if (comms[i] == nullptr) continue;
    if (!error.empty()) {
      api->CommAbort(comms[i]);
      continue;
    }
    registry[{comm_id, members[i].device}] = Handle{comms[i], members[i].rank, members[i].nranks};
  }
  return error;
}

Handle Find(int64_t comm_id, int device) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find({comm_id, device});
  return it == registry.end() ? Handle{} : it->second;
}

void DestroyAll() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (const Api* api = Loaded()) {
    for (auto& [key, h] : registry) api->CommAbort(h.comm);
  }
  registry.clear();
}

std::string WaitDone(const char* op, const Handle& h, cudaStream_t stream, int64_t timeout_ms) {
  std::string error = Poll(op, {h.comm}, stream, timeout_ms);
  if (!error.empty()) {
    Loaded()->CommAbort(h.comm);
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (auto it = registry.begin(); it != registry.end();) {
      it = it->second.comm == h.comm ? registry.erase(it) : std::next(it);
    }
  }
  return error;
}

}  // namespace nccl
}  // namespace trainspec
