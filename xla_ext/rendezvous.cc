// Implementation of the in-process rendezvous (see rendezvous.h for the keying).
//
// Synchronisation: each meeting has one 32-bit `phase` word that moves
// collecting -> all_arrived -> done, or collecting -> failed. Transitions out of `collecting`
// happen under the registry mutex, so "the last member arrived" and "a waiter gave up" cannot
// both win. Waiters spin briefly, yield, then sleep on the word with a futex: on this kind of
// machine (8 device threads, 2 cores) a long spin would steal the core that the member we wait
// for needs, while going straight to sleep costs a wake-up per member even when the peer is a
// few microseconds away. The waiting primitives are in thread_wait.h.
#include "rendezvous.h"
#include "thread_wait.h"

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

namespace trainspec {
namespace {

using Clock = std::chrono::steady_clock;

enum Phase : uint32_t { kCollecting = 0, kAllArrived = 1, kDone = 2, kFailed = 3 };

// Tuned on 2 cores / 8 device threads: enough to catch a peer that is already running,
// short enough not to starve one that is not.
constexpr int kSpins = 256;
constexpr int kYields = 4;
// Runs whose collectives failed are remembered so late members fail fast; bounded so that the
// registry does not grow with the number of failures.
constexpr size_t kMaxFailedRuns = 256;

struct Instance {
  explicit Instance(int n) : ins(n, nullptr), outs(n, nullptr), arrived(n, 0) {}
  std::vector<const void*> ins;  // per rank, filled as members arrive
  std::vector<void*> outs;
  std::vector<uint8_t> arrived;
  Signature signature;
  int first_rank = -1;  // whose signature the others are compared with
  int arrivals = 0;
  int inside = 0;  // members that joined and have not left yet
  std::atomic<uint32_t> phase{kCollecting};
  std::atomic<size_t> next_unit{0};   // kShared: the next unit nobody has taken yet
  std::atomic<size_t> units_done{0};
  Status failure;  // written under the registry mutex before phase becomes kFailed
};

struct Slot {
  explicit Slot(int n) : group_size(n), entries(n, 0) {}
  int group_size;
  std::vector<uint64_t> entries;  // per rank: invocations started since the slot was created
  int inside = 0;
  std::map<uint64_t, std::unique_ptr<Instance>> instances;  // at most two live at a time
};

struct KeyHash {
  size_t operator()(const MeetingKey& k) const {
    uint64_t h = static_cast<uint64_t>(k.run_id) * 0x9E3779B97F4A7C15ull;
    h ^= static_cast<uint64_t>(k.call_site) + 0x632BE59BD9B4E019ull + (h << 6) + (h >> 2);
    h ^= static_cast<uint64_t>(k.group) + 0x94D049BB133111EBull + (h << 6) + (h >> 2);
    return static_cast<size_t>(h);
  }
};
struct KeyEq {
  bool operator()(const MeetingKey& a, const MeetingKey& b) const {
    return a.run_id == b.run_id && a.call_site == b.call_site && a.group == b.group;
  }
};

struct Registry {
  std::mutex mu;
  std::unordered_map<MeetingKey, std::unique_ptr<Slot>, KeyHash, KeyEq> slots;
  std::unordered_map<int64_t, Status> failed_runs;
  std::deque<int64_t> failed_order;

  void RememberFailedRun(int64_t run_id, const Status& why) {
    if (failed_runs.emplace(run_id, why).second) {
      failed_order.push_back(run_id);
      if (failed_order.size() > kMaxFailedRuns) {
        failed_runs.erase(failed_order.front());
        failed_order.pop_front();
      }
    }
  }
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: handlers may run at exit
  return *registry;
}

// Names a meeting in error messages; the text is built only when a message is.
struct Who {
  const char* op_name;
  const MeetingKey& key;
  int group_size;
};

std::ostream& operator<<(std::ostream& s, const Who& w) {
  return s << "trainspec " << w.op_name << " (call site " << w.key.call_site << ", group "
           << w.key.group << " of size " << w.group_size << ", run " << w.key.run_id << ")";
}

std::string RankList(const std::vector<uint8_t>& arrived, uint8_t want) {
  std::ostringstream s;
  s << "[";
  bool first = true;
  for (size_t r = 0; r < arrived.size(); ++r) {
    if (arrived[r] == want) {
      s << (first ? "" : ", ") << r;
      first = false;
    }
  }
  s << "]";
  return s.str();
}

// Marks a still-collecting meeting failed and wakes its members. Registry mutex held.
void FailLocked(Instance* inst, Status why) {
  inst->failure = std::move(why);
  inst->phase.store(kFailed, std::memory_order_release);
  WakeAll(&inst->phase);
}

// Waits until phase is one of `a`/`b`. While the meeting is still collecting and the deadline
// passes, declares it failed (naming the missing ranks) unless it completed meanwhile. After
// all members arrived there is no deadline: the peers are doing bounded work on our buffers,
// and leaving before they finish would be a use-after-free.
uint32_t WaitForPhase(Instance* inst, uint32_t a, uint32_t b, Clock::time_point deadline,
                      const Who& who, int64_t timeout_ms) {
  auto reached = [&](uint32_t p) { return p == a || p == b || p == kFailed; };
  for (int i = 0; i < kSpins; ++i) {
    uint32_t p = inst->phase.load(std::memory_order_acquire);
    if (reached(p)) return p;
    CpuRelax();
  }
  for (int i = 0; i < kYields; ++i) {
    uint32_t p = inst->phase.load(std::memory_order_acquire);
    if (reached(p)) return p;
    std::this_thread::yield();
  }
  for (;;) {
    uint32_t p = inst->phase.load(std::memory_order_acquire);
    if (reached(p)) return p;
    auto now = Clock::now();
    if (p == kCollecting && now >= deadline) {
      Registry& reg = GetRegistry();
      std::lock_guard<std::mutex> lock(reg.mu);
      if (inst->phase.load(std::memory_order_acquire) == kCollecting) {
        std::ostringstream s;
        s << who << ": timed out after " << timeout_ms / 1000.0 << " s waiting for ranks "
          << RankList(inst->arrived, 0) << " (arrived: " << RankList(inst->arrived, 1)
          << "); a member skipped this collective or is stuck";
        FailLocked(inst, Status{Code::kDeadlineExceeded, s.str()});
      }
      continue;
    }
    // Sleep in bounded slices so the deadline is honoured even without a wake-up.
    Clock::duration slice = std::chrono::milliseconds(100);
    if (p == kCollecting) slice = std::min<Clock::duration>(slice, deadline - now);
    SleepWhileEqual(&inst->phase, p, slice);
  }
}

Status Invalid(std::string message) { return Status{Code::kInvalidArgument, std::move(message)}; }

// Fails every meeting of the slot that is still collecting: its members would otherwise wait
// out their timeout for a peer that has already been refused. Registry mutex held.
void FailCollectingLocked(Slot* slot, const Status& why) {
  for (auto& [invocation, inst] : slot->instances) {
    if (inst->phase.load(std::memory_order_acquire) == kCollecting) FailLocked(inst.get(), why);
  }
}

// Checks the arriving member against the slot and the meeting it would join. Registry mutex
// held; returns the refusal (the affected meetings already failed) or OK.
Status AdmitLocked(Registry& reg, const MeetingKey& key, Slot* slot, int rank, int group_size,
                   const Who& who) {
  if (auto it = reg.failed_runs.find(key.run_id); it != reg.failed_runs.end()) {
    std::ostringstream s;
    s << who << ": an earlier collective of this execution failed: " << it->second.message;
    return Status{it->second.code, s.str()};
  }
  if (slot->group_size != group_size) {
    std::ostringstream s;
    s << who << ": rank " << rank << " uses group size " << group_size
      << " but another member of the same group uses " << slot->group_size;
    Status refused = Invalid(s.str());
    FailCollectingLocked(slot, refused);
    reg.RememberFailedRun(key.run_id, refused);
    return refused;
  }
  // A member enters invocation k+1 only after invocation k had all members (see
  // rendezvous.h), so finding this rank still waiting in invocation k means that two devices
  // claim it: fail that meeting now rather than let both wait for the missing rank.
  const uint64_t invocation = slot->entries[rank];
  if (invocation > 0) {
    auto prev = slot->instances.find(invocation - 1);
    if (prev != slot->instances.end() && prev->second->arrived[rank] &&
        prev->second->phase.load(std::memory_order_acquire) == kCollecting) {
      std::ostringstream s;
      s << who << ": rank " << rank << " joined twice (two devices claim the same rank; "
        << "ranks not arrived: " << RankList(prev->second->arrived, 0) << ")";
      Status refused = Invalid(s.str());
      FailLocked(prev->second.get(), refused);
      reg.RememberFailedRun(key.run_id, refused);
      return refused;
    }
  }
  return Status{};
}

// Runs units from the shared counter until none is left; true if this member finished the
// last one (and so marked the meeting done).
bool TakeUnits(Instance* inst, const Work& work, const Peers& peers) {
  bool finished_last = false;
  for (;;) {
    const size_t u = inst->next_unit.fetch_add(1, std::memory_order_relaxed);
    if (u >= work.units) return finished_last;
    work.run(work.op, peers, u);
    if (inst->units_done.fetch_add(1, std::memory_order_acq_rel) + 1 == work.units) {
      inst->phase.store(kDone, std::memory_order_release);
      WakeAll(&inst->phase);
      finished_last = true;
    }
  }
}

}  // namespace

std::string Signature::Difference(const Signature& theirs) const {
  auto show = [](const SignatureField& f) {
    if (f.label != nullptr) return std::string(f.label);
    const std::vector<int64_t>& v = f.values;
    std::ostringstream s;
    s << "[";
    for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
    s << "]";
    return s.str();
  };
  for (size_t i = 0; i < fields.size() || i < theirs.fields.size(); ++i) {
    if (i >= fields.size() || i >= theirs.fields.size()) return "number of attributes";
    const SignatureField& a = fields[i];
    const SignatureField& b = theirs.fields[i];
    if (std::string(a.name) != b.name) return std::string("attribute ") + a.name;
    if (a.values != b.values) {
      return std::string(a.name) + ": " + show(a) + " vs " + show(b);
    }
  }
  return "";
}

Status Meet(const char* op_name, const MeetingKey& key, int rank, int group_size,
            const Signature& signature, const void* in, void* out, int64_t timeout_ms,
            const Work& work) {
  const Who who{op_name, key, group_size};
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  Registry& reg = GetRegistry();
  Slot* slot = nullptr;
  Instance* inst = nullptr;
  uint64_t invocation = 0;
  bool last = false;
  Status refused;

  // Leaving frees the meeting and the slot once nobody is inside; a failure poisons the run.
  auto leave = [&]() {
    std::lock_guard<std::mutex> lock(reg.mu);
    if (inst->phase.load(std::memory_order_acquire) == kFailed) {
      reg.RememberFailedRun(key.run_id, inst->failure);
    }
    if (--inst->inside == 0) slot->instances.erase(invocation);
    if (--slot->inside == 0) reg.slots.erase(key);
  };

  {
    std::lock_guard<std::mutex> lock(reg.mu);
    auto& slot_ptr = reg.slots[key];
    if (!slot_ptr) slot_ptr = std::make_unique<Slot>(group_size);
    slot = slot_ptr.get();
    if (Status s = AdmitLocked(reg, key, slot, rank, group_size, who); !s.ok()) {
      if (slot->inside == 0) reg.slots.erase(key);
      return s;
    }
    invocation = slot->entries[rank]++;
    auto& inst_ptr = slot->instances[invocation];
    if (!inst_ptr) inst_ptr = std::make_unique<Instance>(group_size);
    inst = inst_ptr.get();
    ++slot->inside;
    ++inst->inside;

    if (inst->phase.load(std::memory_order_acquire) == kFailed) {
      refused = inst->failure;
    } else if (inst->first_rank >= 0) {
      if (std::string diff = signature.Difference(inst->signature); !diff.empty()) {
        std::ostringstream s;
        s << who << ": rank " << rank << " disagrees with rank " << inst->first_rank
          << " on " << diff;
        FailLocked(inst, Invalid(s.str()));
        refused = inst->failure;
      }
    } else {
      inst->first_rank = rank;
      inst->signature = signature;
    }
    if (refused.ok()) {
      inst->ins[rank] = in;
      inst->outs[rank] = out;
      inst->arrived[rank] = 1;
      if (++inst->arrivals == group_size) {
        inst->phase.store(kAllArrived, std::memory_order_release);
        last = true;
      }
    }
  }
  if (!refused.ok()) {
    leave();
    return refused;
  }

  const Peers peers{inst->ins.data(), inst->outs.data(), group_size};
  uint32_t phase;
  if (work.plan == Plan::kLastArriverForAll || work.units == 0) {
    if (last) {
      for (size_t u = 0; u < work.units; ++u) work.run(work.op, peers, u);
      inst->phase.store(kDone, std::memory_order_release);
      WakeAll(&inst->phase);
      phase = kDone;
    } else {
      phase = WaitForPhase(inst, kDone, kDone, deadline, who, timeout_ms);
    }
  } else {
    if (last) {
      WakeAll(&inst->phase);
      phase = kAllArrived;
    } else {
      phase = WaitForPhase(inst, kAllArrived, kDone, deadline, who, timeout_ms);
    }
    if (phase == kAllArrived) {
      phase = TakeUnits(inst, work, peers)
                  ? kDone
                  : WaitForPhase(inst, kDone, kDone, deadline, who, timeout_ms);
    }
  }
  Status result = phase == kFailed ? inst->failure : Status{};
  leave();
  return result;
}

int64_t LiveRendezvousCount() {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  return static_cast<int64_t>(reg.slots.size());
}

}  // namespace trainspec
