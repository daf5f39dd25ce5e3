// Grid sizing shared by the .cu kernels: grid-stride loops over `count` items with at most
// kMaxBlocks blocks of kThreads threads (enough to fill an H100/H200 several times over).
#pragma once

#include <cstddef>

namespace trainspec {
namespace cuda {

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 8192;

inline unsigned GridFor(size_t count) {
  const size_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks == 0 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks));
}

__device__ inline size_t GlobalThread() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline size_t GridThreads() { return static_cast<size_t>(gridDim.x) * blockDim.x; }

}  // namespace cuda
}  // namespace trainspec
