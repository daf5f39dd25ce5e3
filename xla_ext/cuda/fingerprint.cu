// The fingerprint on CUDA (device_kernels.h): every word's term (fingerprint_words.h) summed
// modulo 2^64. The sum is commutative and associative in wrapping arithmetic, so per-thread
// partial sums, a warp shuffle tree and atomic adds give the CPU loop's value exactly.
#include "device_kernels.h"
#include "fingerprint_words.h"
#include "launch.cuh"

namespace trainspec {
namespace cuda {
namespace {

using namespace fingerprint;  // NOLINT: the checksum is written in its terms

__global__ void SumTerms(const uint8_t* data, size_t nbytes, unsigned long long* sum) {
  unsigned long long partial = 0;
  for (size_t i = GlobalThread(); i < Words(nbytes); i += GridThreads()) {
    partial += WordTerm(WordAt(data, nbytes, i), i);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    partial += __shfl_xor_sync(0xFFFFFFFFu, partial, offset);
  }
  if (threadIdx.x % 32 == 0) atomicAdd(sum, partial);
}

__global__ void FinishFingerprint(size_t nbytes, unsigned long long* sum_then_result) {
  *sum_then_result = Finish(*sum_then_result, nbytes);  // low word first: little-endian
}

}  // namespace

cudaError_t LaunchFingerprint(const uint8_t* data, size_t nbytes, uint32_t* out,
                              cudaStream_t stream) {
  // The two output words, 8-byte aligned like every XLA buffer, hold the running sum.
  auto* sum = reinterpret_cast<unsigned long long*>(out);
  cudaError_t e = cudaMemsetAsync(sum, 0, sizeof(*sum), stream);
  if (e != cudaSuccess) return e;
  SumTerms<<<GridFor(Words(nbytes)), kThreads, 0, stream>>>(data, nbytes, sum);
  FinishFingerprint<<<1, 1, 0, stream>>>(nbytes, sum);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace trainspec
