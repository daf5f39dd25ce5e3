// C++ harness of the xla_ext collectives: the rendezvous and the kernels driven by threads,
// without Python or XLA (tests/test_xla_ext_harness.py runs it under ThreadSanitizer).
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
// Exit status 0 when every check passed; each failed check prints one line.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collective_ops.h"

namespace trainspec {
namespace {

int failed_checks = 0;
int checks = 0;

void Check(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failed_checks;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

// ---- kernels ------------------------------------------------------------------------------

template <typename T>
T Combine(RedOp op, T a, T b) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kMean:
      if constexpr (std::is_integral<T>::value) {
        return static_cast<T>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
      } else {
        return a + b;
      }
    case RedOp::kMax: return (a > b || a != a) ? a : b;
    case RedOp::kMin: return (a < b || a != a) ? a : b;
  }
  return a;
}

// The documented semantics, one element at a time: combine sources 0..n-1 in rank order.
template <typename T>
T Reference(RedOp op, const std::vector<const T*>& srcs, size_t offset, size_t i) {
  T acc = srcs[0][offset + i];
  for (size_t s = 1; s < srcs.size(); ++s) acc = Combine(op, acc, srcs[s][offset + i]);
  if (op == RedOp::kMean) acc = acc / static_cast<T>(srcs.size());
  return acc;
}

// Replaces every NaN by one canonical NaN: which NaN's payload and sign a sum of NaNs keeps is
// left open by IEEE 754 and differs between the vector widths (docs/xla_ext.md).
void CanonicalNans(ElemType type, std::vector<uint8_t>& bytes) {
  const size_t elem = ElemBytes(type);
  for (size_t i = 0; i + elem <= bytes.size(); i += elem) {
    uint64_t v = 0;
    std::memcpy(&v, &bytes[i], elem);
    uint64_t exp_mask = 0, mant_mask = 0;
    switch (type) {
      case ElemType::kF32: exp_mask = 0x7F800000u; mant_mask = 0x7FFFFFu; break;
      case ElemType::kF64: exp_mask = 0x7FF0000000000000ull; mant_mask = 0xFFFFFFFFFFFFFull; break;
      case ElemType::kBF16: exp_mask = 0x7F80u; mant_mask = 0x7Fu; break;
      case ElemType::kF16: exp_mask = 0x7C00u; mant_mask = 0x3FFu; break;
      case ElemType::kS32: return;
    }
    if ((v & exp_mask) == exp_mask && (v & mant_mask) != 0) {
      v = exp_mask | (mant_mask & ~(mant_mask >> 1));  // positive quiet NaN
      std::memcpy(&bytes[i], &v, elem);
    }
  }
}

uint64_t Fnv(uint64_t h, const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  return h;
}

// Random bytes with a good share of special values: NaN, inf, zero, subnormal, huge.
std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t bytes, size_t elem) {
  std::vector<uint8_t> b(bytes);
  for (auto& v : b) v = static_cast<uint8_t>(rng());
  for (size_t i = 0; i + elem <= bytes; i += elem) {
    if (rng() % 8 == 0) std::memset(&b[i + elem - 1], rng() % 2 ? 0x7F : 0xFF, 1);  // exp ~max
    if (rng() % 16 == 0) std::memset(&b[i], 0, elem);
  }
  return b;
}

// Bit for bit, except that any NaN matches any NaN: IEEE 754 leaves open which operand's
// payload a sum of two NaNs keeps, and the compiler may commute the scalar reference's add.
template <typename T>
void CheckAgainstReference(RedOp op, const std::vector<const void*>& untyped, size_t so,
                           const void* got, size_t count, const std::string& what) {
  std::vector<const T*> srcs;
  for (const void* p : untyped) srcs.push_back(static_cast<const T*>(p));
  const T* dst = static_cast<const T*>(got);
  for (size_t i = 0; i < count; ++i) {
    const T want = Reference(op, srcs, so, i);
    const bool both_nan = want != want && dst[i] != dst[i];
    if (!both_nan && std::memcmp(&want, &dst[i], sizeof(T)) != 0) {
      Check(false, what + " element " + std::to_string(i));
      return;
    }
  }
  Check(true, what);
}

uint64_t TestKernels() {
  std::mt19937_64 rng(20261130);
  uint64_t digest = 0xCBF29CE484222325ull;
  const ElemType types[] = {ElemType::kF32, ElemType::kF64, ElemType::kS32, ElemType::kBF16,
                            ElemType::kF16};
  const RedOp ops[] = {RedOp::kSum, RedOp::kMean, RedOp::kMax, RedOp::kMin};
  const size_t counts[] = {0, 1, 31, 33, 64, 257, 4099};
  for (ElemType type : types) {
    const size_t elem = ElemBytes(type);
    for (RedOp op : ops) {
      if (op == RedOp::kMean && type == ElemType::kS32) continue;
      for (size_t count : counts) {
        for (int n : {1, 3, 8}) {
          for (int m : {1, 3}) {
            for (size_t misalign : {size_t{0}, size_t{1}}) {  // elements, so unaligned bytes
              std::vector<std::vector<uint8_t>> in;
              std::vector<const void*> srcs;
              for (int s = 0; s < n; ++s) {
                in.push_back(RandomBytes(rng, (count + misalign) * elem, elem));
                srcs.push_back(in.back().data());
              }
              std::vector<std::vector<uint8_t>> out(m, std::vector<uint8_t>((count + 1) * elem));
              std::vector<void*> dsts;
              for (auto& o : out) dsts.push_back(o.data());
              ReduceInto(type, op, srcs.data(), misalign, n, dsts.data(), 1, m, count,
                         count % 2 == 1);
              const std::string what = "kernel type " + std::to_string(static_cast<int>(type)) +
                                       " op " + std::to_string(static_cast<int>(op)) +
                                       " count " + std::to_string(count) + " n " +
                                       std::to_string(n) + " m " + std::to_string(m);
              for (int d = 1; d < m; ++d) {
                Check(std::memcmp(out[d].data(), out[0].data(), out[0].size()) == 0,
                      what + ": destinations differ");
              }
              const void* got = out[0].data() + elem;
              if (type == ElemType::kF32) {
                CheckAgainstReference<float>(op, srcs, misalign, got, count, what);
              } else if (type == ElemType::kF64) {
                CheckAgainstReference<double>(op, srcs, misalign, got, count, what);
              } else if (type == ElemType::kS32) {
                CheckAgainstReference<int32_t>(op, srcs, misalign, got, count, what);
              }
              CanonicalNans(type, out[0]);
              digest = Fnv(digest, out[0].data(), out[0].size());
            }
          }
        }
      }
    }
  }
  return digest;
}

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
      Check(false, what + ": " + o.status.message);
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
      Check(ok, what + " values");
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
      Check(ok, "reduce_scatter values" + size);
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
      Check(ok, "all_gather values" + size);
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
      Check(ok, "all_to_all values" + size);
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
      Check(ok, "broadcast and permute values" + size);
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
  Check(wrong == 0, "two groups x 30 invocations: " + std::to_string(wrong.load()) + " wrong");
}

// ---- failures -----------------------------------------------------------------------------

// Every member fails with `code`, `needle` in its message, and none waited for the timeout.
void ExpectAllFail(const std::vector<Outcome>& outcomes, Code code, const std::string& needle,
                   double under_s, const std::string& what) {
  for (size_t t = 0; t < outcomes.size(); ++t) {
    const Outcome& o = outcomes[t];
    Check(o.status.code == code && o.status.message.find(needle) != std::string::npos,
          what + " member " + std::to_string(t) + ": code " +
              std::to_string(static_cast<int>(o.status.code)) + " \"" + o.status.message +
              "\"");
    Check(o.seconds < under_s, what + " member " + std::to_string(t) + " took " +
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

namespace trainspec {
std::pair<int, int> TestPackedKernels();  // packed_kernels_test.cc
}  // namespace trainspec

int main() {
  using namespace trainspec;
  const uint64_t digest = TestKernels();
  TestOps(8, 64);            // everything below 256 KiB: the last arriver does all units
  TestOps(8, 1 << 16);       // 256 KiB per member: members share the units
  TestOps(8, 5 * 8 * 1024);  // a length that does not fill the last unit
  TestGroupsAndRepeats();
  TestFailures();
  const auto [packed_checks, packed_failed] = TestPackedKernels();
  checks += packed_checks;
  failed_checks += packed_failed;
  Check(LiveRendezvousCount() == 0, "rendezvous state left: " +
                                        std::to_string(LiveRendezvousCount()) + " slots");
  std::printf("isa %s\nkernel digest %016llx\n%d checks, %d failed\n", IsaName(ActiveIsa()),
              static_cast<unsigned long long>(digest), checks, failed_checks);
  return failed_checks == 0 ? 0 : 1;
}
