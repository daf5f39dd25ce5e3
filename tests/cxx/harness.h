// What the parts of the C++ harness share: the tally of checks, and each part's entry point.
#ifndef TRAINSPEC_TESTS_CXX_HARNESS_H_
#define TRAINSPEC_TESTS_CXX_HARNESS_H_

#include <cstdint>
#include <cstdio>
#include <string>

namespace trainspec {

// Counts checks; a failed one prints one line naming what failed.
struct Tally {
  int checks = 0;
  int failed = 0;
  void Check(bool ok, const std::string& what) {
    ++checks;
    if (!ok) {
      ++failed;
      std::printf("FAILED: %s\n", what.c_str());
    }
  }
};

// The reduction kernels against the rank-order reference; returns the digest of their outputs
// (reduce_kernels_test.cc).
uint64_t TestReduceKernels(Tally& t);

// The packed-buffer kernels of collectives.compression (packed_kernels_test.cc).
void TestPackedKernels(Tally& t);

}  // namespace trainspec

#endif  // TRAINSPEC_TESTS_CXX_HARNESS_H_
