// C++ harness of the xla_ext collectives: the rendezvous and the kernels driven by threads,
// without Python or XLA (tests/jax/test_xla_ext_harness.py runs it under ThreadSanitizer).
//
//   kernels      ReduceInto on random bit patterns (NaN and inf included), odd lengths,
//                misaligned buffers, 1..8 sources and 1..3 destinations: float32/float64/int32
//                against a scalar rank-order reference bit for bit; every dtype feeds a digest
//                that is printed, so runs under different TRAINSPEC_XLA_EXT_ISA variants can
//                be compared;
//   collectives  each op with 8 threads (and two groups of 4 at once) against a reference,
//                both work plans, and 30 invocations of one call site back to back;
//   failures     a missing member (deadline exceeded, then the run fails fast), a duplicate
//                rank, a group-size mismatch, disagreeing attributes or shapes, a bad rank
//                (invalid argument, at once), and no rendezvous state left afterwards;
//   packed       the compression kernels against their scalar reference (packed_kernels_test.cc).
// The kernels' part is in reduce_kernels_test.cc, the packed part in packed_kernels_test.cc.
// Exit status 0 when every check passed; each failed check prints one line.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collective_ops.h"
#include "harness.h"

namespace trainspec {
namespace {

Tally tally;

// ---- collectives --------------------------------------------------------------------------

std::atomic<int64_t> next_run{1};  // a fresh run id per scenario, as XLA gives per execution

struct Outcome {
  Status status;
  double seconds;
};

// Runs `make(t)`'s call on thread t for every t < threads, all at once.
std::vector<Outcome> RunThreads(Collective op, int threads,
                                const std::function<CollectiveCall(int)>& make) {
  std::vector<Outcome> outcomes(threads);
  std::vector<CollectiveCall> calls;
  for (int t = 0; t < threads; ++t) calls.push_back(make(t));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const auto start = std::chrono::steady_clock::now();
      outcomes[t].status = RunCollective(op, calls[t]);
      outcomes[t].seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  }
  for (auto& th : pool) th.join();
  return outcomes;
}

// Member r's input: small integers, so every sum is exact in any order.
float Value(int r, size_t i, int iteration) {
  return static_cast<float>(static_cast<int>((i * 7 + r * 3 + iteration) % 13) - 6);
}

struct Buffers {
  std::vector<std::vector<float>> in, out;
};

Buffers MakeBuffers(int n, size_t in_count, size_t out_count, int iteration = 0) {
  Buffers b;
  for (int r = 0; r < n; ++r) {
    b.in.emplace_back(in_count);
    for (size_t i = 0; i < in_count; ++i) b.in[r][i] = Value(r, i, iteration);
    b.out.emplace_back(out_count, -99.0f);
  }
  return b;
}

CollectiveCall Call(int64_t run, int64_t group, int rank, int n, std::vector<int64_t> in_dims,
                    std::vector<int64_t> out_dims, const void* in, void* out,
                    std::vector<int64_t> attrs, int64_t timeout_ms = 20000) {
  return CollectiveCall{MeetingKey{run, 0, group}, rank, n, timeout_ms, ElemType::kF32,
                        std::move(in_dims), std::move(out_dims), in, out, std::move(attrs)};
}

bool AllOk(const std::vector<Outcome>& outcomes, const std::string& what) {
  bool ok = true;
  for (const Outcome& o : outcomes) {
    if (!o.status.ok()) {
      tally.Check(false, what + ": " + o.status.message);
      ok = false;
    }
  }
  return ok;
}

// Every op on a 1-D group of n, with `len` elements per member (a multiple of n), checked
// element by element against the op's definition.
void TestOps(int n, size_t len) {
  const std::string size = " n=" + std::to_string(n) + " len=" + std::to_string(len);
  const int64_t L = static_cast<int64_t>(len);
  for (bool in_place : {false, true}) {  // all_reduce, sum; in place: output = input buffer
    Buffers b = MakeBuffers(n, len, len);
    const Buffers before = b;
    auto& out = in_place ? b.in : b.out;
    const std::string what = std::string("all_reduce") + (in_place ? " in place" : "") + size;
    const int64_t run = next_run++;
    if (AllOk(RunThreads(Collective::kAllReduce, n, [&](int r) {
          return Call(run, 0, r, n, {L}, {L}, b.in[r].data(), out[r].data(), {kSum});
        }), what)) {
      bool ok = true;
      for (int r = 0; r < n; ++r) {
        for (size_t i = 0; i < len; ++i) {
          float want = 0;
          for (int s = 0; s < n; ++s) want += before.in[s][i];
          ok &= out[r][i] == want;
        }
      }
      tally.Check(ok, what + " values");
    }
  }
  {  // reduce_scatter along dimension 0 of (n, len / n)
    Buffers b = MakeBuffers(n, len, len / n);
    const int64_t run = next_run++;
    if (AllOk(RunThreads(Collective::kReduceScatter, n, [&](int r) {
          return Call(run, 0, r, n, {n, L / n}, {1, L / n}, b.in[r].data(), b.out[r].data(),
                      {kSum, 0});
        }), "reduce_scatter" + size)) {
      bool ok = true;
      for (int r = 0; r < n; ++r) {
        for (size_t i = 0; i < len / n; ++i) {
          float want = 0;
          for (int s = 0; s < n; ++s) want += b.in[s][r * (len / n) + i];
          ok &= b.out[r][i] == want;
        }
      }
      tally.Check(ok, "reduce_scatter values" + size);
    }
  }
  {  // all_gather along axis 0
    Buffers b = MakeBuffers(n, len / n, len);
    const int64_t run = next_run++;
    if (AllOk(RunThreads(Collective::kAllGather, n, [&](int r) {
          return Call(run, 0, r, n, {L / n}, {L}, b.in[r].data(), b.out[r].data(), {0});
        }), "all_gather" + size)) {
      bool ok = true;
      for (int r = 0; r < n; ++r) {
        for (size_t i = 0; i < len; ++i) ok &= b.out[r][i] == b.in[i / (len / n)][i % (len / n)];
      }
      tally.Check(ok, "all_gather values" + size);
    }
  }
  {  // all_to_all of (2, len / 2): split axis 1, concat axis 0 -> (2n, len / 2n)
    const int64_t rows = 2, cols = L / 2, c = cols / n;
    Buffers b = MakeBuffers(n, len, len);
    const int64_t run = next_run++;
    if (AllOk(RunThreads(Collective::kAllToAll, n, [&](int r) {
          return Call(run, 0, r, n, {rows, cols}, {rows * n, c}, b.in[r].data(),
                      b.out[r].data(), {1, 0});
        }), "all_to_all" + size)) {
      bool ok = true;
      for (int r = 0; r < n; ++r) {
        for (int64_t s = 0; s < n; ++s) {
          for (int64_t i = 0; i < rows; ++i) {
            for (int64_t j = 0; j < c; ++j) {
              ok &= b.out[r][(s * rows + i) * c + j] == b.in[s][i * cols + r * c + j];
            }
          }
        }
      }
      tally.Check(ok, "all_to_all values" + size);
    }
  }
  {  // broadcast from the last rank, and permute: rank r receives from r - 1, rank 0 zeros
    Buffers b = MakeBuffers(n, len, len);
    Buffers p = MakeBuffers(n, len, len);
    std::vector<int64_t> sources{-1};
    for (int r = 1; r < n; ++r) sources.push_back(r - 1);
    const int64_t run = next_run++;
    const bool ran = AllOk(RunThreads(Collective::kBroadcast, n, [&](int r) {
      return Call(run, 0, r, n, {L}, {L}, b.in[r].data(), b.out[r].data(), {n - 1});
    }), "broadcast" + size) && AllOk(RunThreads(Collective::kPermute, n, [&](int r) {
      return Call(run, 1, r, n, {L}, {L}, p.in[r].data(), p.out[r].data(), sources);
    }), "permute" + size);
    if (ran) {
      bool ok = true;
      for (int r = 0; r < n; ++r) {
        ok &= b.out[r] == b.in[n - 1];
        ok &= r == 0 ? p.out[r] == std::vector<float>(len, 0.0f) : p.out[r] == p.in[r - 1];
      }
      tally.Check(ok, "broadcast and permute values" + size);
    }
  }
}

// Two groups of 4 at the same call site of one run, 30 invocations each back to back (the
// per-slot invocation counter pairs the k-th calls), checked every time.
void TestGroupsAndRepeats() {
  constexpr int kThreads = 8, kGroup = 4, kIterations = 30;
  constexpr size_t kLen = 1024;
  const int64_t run = next_run++;
  std::vector<std::thread> pool;
  std::atomic<int> wrong{0};
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] {
      const int group = t / kGroup, rank = t % kGroup;
      std::vector<float> in(kLen), out(kLen);
      for (int it = 0; it < kIterations; ++it) {
        for (size_t i = 0; i < kLen; ++i) in[i] = Value(t, i, it);
        const Status s = RunCollective(Collective::kAllReduce,
                                       Call(run, group, rank, kGroup, {kLen}, {kLen}, in.data(),
                                            out.data(), {kMax}));
        if (!s.ok()) {
          wrong++;
          continue;
        }
        for (size_t i = 0; i < kLen; ++i) {
          float want = Value(group * kGroup, i, it);
          for (int r = 1; r < kGroup; ++r) want = std::max(want, Value(group * kGroup + r, i, it));
          if (out[i] != want) wrong++;
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  tally.Check(wrong == 0,
              "two groups x 30 invocations: " + std::to_string(wrong.load()) + " wrong");
}

// ---- failures -----------------------------------------------------------------------------

// Every member fails with `code`, `needle` in its message, and none waited for the timeout.
void ExpectAllFail(const std::vector<Outcome>& outcomes, Code code, const std::string& needle,
                   double under_s, const std::string& what) {
  for (size_t t = 0; t < outcomes.size(); ++t) {
    const Outcome& o = outcomes[t];
    tally.Check(o.status.code == code && o.status.message.find(needle) != std::string::npos,
          what + " member " + std::to_string(t) + ": code " +
              std::to_string(static_cast<int>(o.status.code)) + " \"" + o.status.message +
              "\"");
    tally.Check(o.seconds < under_s, what + " member " + std::to_string(t) + " took " +
                                   std::to_string(o.seconds) + " s");
  }
}

void TestFailures() {
  constexpr int n = 8;
  constexpr int64_t kLong = 20000;  // ms: a failure that waits for this is a bug here
  Buffers b = MakeBuffers(n, 64, 64);
  auto all_reduce = [&](int64_t run, int rank, int size, int64_t reduce_op, int64_t timeout_ms,
                        std::vector<int64_t> dims = {64}) {
    const int own = std::min(rank, n - 1);  // buffers also for a rank out of range
    return Call(run, 0, rank, size, dims, dims, b.in[own].data(), b.out[own].data(),
                {reduce_op}, timeout_ms);
  };
  {  // rank 7 never arrives; afterwards it arrives late and fails at once
    const int64_t run = next_run++;
    ExpectAllFail(RunThreads(Collective::kAllReduce, n - 1,
                             [&](int r) { return all_reduce(run, r, n, kSum, 300); }),
                  Code::kDeadlineExceeded, "waiting for ranks [7]", 10.0, "missing member");
    ExpectAllFail(RunThreads(Collective::kAllReduce, 1,
                             [&](int) { return all_reduce(run, 7, n, kSum, kLong); }),
                  Code::kDeadlineExceeded, "an earlier collective of this execution failed",
                  1.0, "late member of a failed run");
  }
  {  // devices 6 and 7 both claim rank 6
    const int64_t run = next_run++;
    ExpectAllFail(RunThreads(Collective::kAllReduce, n, [&](int r) {
      return all_reduce(run, std::min(r, 6), n, kSum, kLong);
    }),
                  Code::kInvalidArgument, "rank 6 joined twice", 5.0, "duplicate rank");
  }
  {  // device 7 says the group has 4 members
    const int64_t run = next_run++;
    ExpectAllFail(RunThreads(Collective::kAllReduce, n, [&](int r) {
      return r == 7 ? all_reduce(run, 3, 4, kSum, kLong) : all_reduce(run, r, n, kSum, kLong);
    }), Code::kInvalidArgument, "group size", 5.0, "group-size mismatch");
  }
  {  // rank 5 asks for a max, the others for a sum
    const int64_t run = next_run++;
    ExpectAllFail(RunThreads(Collective::kAllReduce, n, [&](int r) {
      return all_reduce(run, r, n, r == 5 ? kMax : kSum, kLong);
    }), Code::kInvalidArgument, "on reduce_op: [", 5.0, "attribute mismatch");
  }
  {  // rank 2 has the same element count in another shape
    const int64_t run = next_run++;
    ExpectAllFail(RunThreads(Collective::kAllReduce, n, [&](int r) {
      return all_reduce(run, r, n, kSum, kLong, r == 2 ? std::vector<int64_t>{8, 8}
                                                       : std::vector<int64_t>{64});
    }), Code::kInvalidArgument, "on input shape: [", 5.0, "shape mismatch");
  }
  {  // checks one member makes alone
    const int64_t run = next_run++;
    ExpectAllFail(RunThreads(Collective::kAllReduce, 1,
                             [&](int) { return all_reduce(run, 9, n, kSum, kLong); }),
                  Code::kInvalidArgument, "rank 9 out of range for group size 8", 1.0,
                  "rank out of range");
    ExpectAllFail(RunThreads(Collective::kAllGather, 1, [&](int) {
      return Call(run, 0, 0, n, {64}, {64}, b.in[0].data(), b.out[0].data(), {0}, kLong);
    }), Code::kInvalidArgument, "output shape [64] should be [512]", 1.0, "output shape");
  }
}

}  // namespace
}  // namespace trainspec

int main() {
  using namespace trainspec;
  const uint64_t digest = TestReduceKernels(tally);
  TestOps(8, 64);            // everything below 256 KiB: the last arriver does all units
  TestOps(8, 1 << 16);       // 256 KiB per member: members share the units
  TestOps(8, 5 * 8 * 1024);  // a length that does not fill the last unit
  TestGroupsAndRepeats();
  TestFailures();
  TestPackedKernels(tally);
  tally.Check(LiveRendezvousCount() == 0, "rendezvous state left: " +
                                        std::to_string(LiveRendezvousCount()) + " slots");
  std::printf("isa %s\nkernel digest %016llx\n%d checks, %d failed\n", IsaName(ActiveIsa()),
              static_cast<unsigned long long>(digest), tally.checks, tally.failed);
  return tally.failed == 0 ? 0 : 1;
}
