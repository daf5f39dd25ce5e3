// The packed-buffer kernels on CUDA (device_kernels.h): packed_format.h's element operations,
// walked by threads. int8: one warp per scale block; its absmax is a max over the block (an
// order-free reduction, so the warp's shuffle tree gives the CPU loop's value) and every element
// is then quantized on its own. bf16 and dequantize-and-sum: one thread per element, the k
// buffers summed in buffer order like the CPU kernel.
#include "device_kernels.h"
#include "launch.cuh"

namespace trainspec {
namespace cuda {
namespace {

using namespace packed;  // NOLINT: the kernels below are written in its terms

constexpr int kWarp = 32;
constexpr unsigned kAllLanes = 0xFFFFFFFFu;

__device__ inline float Corrected(const float* x, const float* residual, size_t i) {
  return residual ? x[i] + residual[i] : x[i];
}

__device__ inline void WriteHeader(const PackedFormat& f, uint8_t* packed) {
  if (GlobalThread() == 0) *reinterpret_cast<PackedHeader*>(packed) = f.header();
}

__global__ void PackInt8(PackedFormat f, const float* x, const float* residual, uint8_t* packed,
                         float* lost) {
  WriteHeader(f, packed);
  const size_t warps = GridThreads() / kWarp;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  for (size_t b = GlobalThread() / kWarp; b < f.blocks(); b += warps) {
    const size_t start = b * f.block;
    const size_t len = f.n - start < f.block ? f.n - start : f.block;
    float absmax = 0.0f;
    bool any_nan = false;
    for (size_t i = lane; i < len; i += kWarp) {
      const float a = AbsOf(Corrected(x, residual, start + i));
      any_nan |= a != a;
      absmax = MaxOf(a, absmax);
    }
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      absmax = MaxOf(__shfl_xor_sync(kAllLanes, absmax, offset), absmax);
    }
    any_nan = __any_sync(kAllLanes, any_nan);
    const float scale = BlockScale(absmax, any_nan);
    const float inverse = BlockInverse(scale);
    int8_t* q = reinterpret_cast<int8_t*>(packed + f.payload_offset()) + start;
    for (size_t i = lane; i < f.block; i += kWarp) {
      if (i >= len) {
        q[i] = 0;  // padding of the last block
        continue;
      }
      const float v = Corrected(x, residual, start + i);
      q[i] = QuantizeElement(v, inverse);
      if (lost) lost[start + i] = v - DequantizeElement(q[i], scale);
    }
    if (lane == 0) reinterpret_cast<float*>(packed + f.scales_offset())[b] = scale;
  }
}

__global__ void PackBf16(PackedFormat f, const float* x, const float* residual, uint8_t* packed,
                         float* lost) {
  WriteHeader(f, packed);
  uint16_t* payload = reinterpret_cast<uint16_t*>(packed + kHeaderBytes);
  for (size_t i = GlobalThread(); i < f.n + f.n % 2; i += GridThreads()) {
    if (i == f.n) {
      payload[i] = 0;  // the padding of an odd count
      continue;
    }
    const float v = Corrected(x, residual, i);
    payload[i] = ToBf16Bits(v);
    if (lost) lost[i] = v - FromBf16Bits(payload[i]);
  }
}

__device__ inline float Unpacked(const PackedFormat& f, const uint8_t* p, size_t i) {
  if (f.code == kFormatBf16) {
    return FromBf16Bits(reinterpret_cast<const uint16_t*>(p + kHeaderBytes)[i]);
  }
  const float scale = reinterpret_cast<const float*>(p + f.scales_offset())[i / f.block];
  return DequantizeElement(reinterpret_cast<const int8_t*>(p + f.payload_offset())[i], scale);
}

__global__ void DequantizeSum(PackedFormat f, const uint8_t* packed, size_t k, float* out) {
  const size_t bytes = f.bytes();
  for (size_t i = GlobalThread(); i < f.n; i += GridThreads()) {
    float sum = Unpacked(f, packed, i);
    for (size_t r = 1; r < k; ++r) sum = sum + Unpacked(f, packed + r * bytes, i);
    out[i] = sum;
  }
}

}  // namespace

cudaError_t LaunchPack(const PackedFormat& f, const float* x, const float* residual,
                       uint8_t* packed, float* lost, cudaStream_t stream) {
  if (f.code == kFormatInt8) {
    PackInt8<<<GridFor(f.blocks() * kWarp), kThreads, 0, stream>>>(f, x, residual, packed, lost);
  } else {
    PackBf16<<<GridFor(f.n + 1), kThreads, 0, stream>>>(f, x, residual, packed, lost);
  }
  return cudaGetLastError();
}

cudaError_t LaunchDequantizeSum(const PackedFormat& f, const uint8_t* packed, size_t k,
                                float* out, cudaStream_t stream) {
  DequantizeSum<<<GridFor(f.n), kThreads, 0, stream>>>(f, packed, k, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace trainspec
