// The rank-order reduction on CUDA (device_kernels.h): for each element, the scalar form of the
// CPU kernel's operations (reduce_elements.h) -- load row 0, one combine per further row in row
// order, the optional division, one rounding -- so the result equals ReduceInto's bit for bit.
#include "device_kernels.h"
#include "launch.cuh"
#include "reduce_elements.h"

namespace trainspec {
namespace cuda {
namespace {

using namespace lanes;  // NOLINT: the kernel is written in its terms

template <typename T, typename Op, bool kMean>
__global__ void ReduceRows(const T* rows, int n, size_t count, T* out) {
  const Op op{};
  for (size_t i = GlobalThread(); i < count; i += GridThreads()) {
    typename Num<T>::Acc a = Num<T>::Load(rows[i]);
    for (int s = 1; s < n; ++s) a = op(a, Num<T>::Load(rows[s * count + i]));
    if (kMean) a = a / static_cast<typename Num<T>::Acc>(n);
    out[i] = Num<T>::Store(a);
  }
}

template <typename T>
cudaError_t LaunchTyped(RedOp op, const void* rows, int n, size_t count, void* out,
                        cudaStream_t stream) {
  const T* r = static_cast<const T*>(rows);
  T* o = static_cast<T*>(out);
  const unsigned grid = GridFor(count);
  switch (op) {
    case RedOp::kSum: ReduceRows<T, AddOp, false><<<grid, kThreads, 0, stream>>>(r, n, count, o);
      break;
    case RedOp::kMean: ReduceRows<T, AddOp, true><<<grid, kThreads, 0, stream>>>(r, n, count, o);
      break;
    case RedOp::kMax: ReduceRows<T, MaxOp, false><<<grid, kThreads, 0, stream>>>(r, n, count, o);
      break;
    case RedOp::kMin: ReduceRows<T, MinOp, false><<<grid, kThreads, 0, stream>>>(r, n, count, o);
      break;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchReduceRows(ElemType type, RedOp op, const void* rows, int n, size_t count,
                             void* out, cudaStream_t stream) {
  switch (type) {
    case ElemType::kF32: return LaunchTyped<float>(op, rows, n, count, out, stream);
    case ElemType::kF64: return LaunchTyped<double>(op, rows, n, count, out, stream);
    case ElemType::kS32: return LaunchTyped<int32_t>(op, rows, n, count, out, stream);
    case ElemType::kBF16: return LaunchTyped<Bf16>(op, rows, n, count, out, stream);
    case ElemType::kF16: return LaunchTyped<F16>(op, rows, n, count, out, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace trainspec
