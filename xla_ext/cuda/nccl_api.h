// The part of NCCL's public C API that the collectives use, declared here as types and function
// pointer types: NCCL is loaded at run time (dlopen of libnccl.so.2, normally the nvidia-nccl
// wheel's, trainspec/jax/collectives/nccl.py), so neither building nor importing the CUDA module
// needs NCCL, and a CPU install needs nothing. The values are NCCL's documented ABI; where the
// build finds nccl.h (the wheel ships it: TRAINSPEC_HAVE_NCCL_H), nccl_api.cc checks every
// declaration here against it at compile time.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

namespace trainspec {
namespace nccl {

struct Comm;  // NCCL's opaque struct ncclComm
using Comm_t = Comm*;

constexpr size_t kUniqueIdBytes = 128;
struct UniqueId {
  char internal[kUniqueIdBytes];
};

enum Result : int { kSuccess = 0, kInProgress = 7 };  // the other values are errors
enum RedOp : int { kSum = 0, kMax = 2, kMin = 3, kAvg = 4 };
enum DataType : int {
  kInt8 = 0, kUint8 = 1, kInt32 = 2, kFloat16 = 6, kFloat32 = 7, kFloat64 = 8, kBfloat16 = 9
};

// ncclConfig_t as of NCCL 2.18 (its `version` field tells a newer NCCL which fields follow).
constexpr unsigned kConfigMagic = 0xcafebeef;
constexpr unsigned kConfigVersion = 21800;
constexpr int kConfigUndefInt = -2147483647 - 1;  // INT_MIN
struct Config {
  size_t size = sizeof(Config);
  unsigned magic = kConfigMagic;
  unsigned version = kConfigVersion;
  int blocking = kConfigUndefInt;
  int cgaClusterSize = kConfigUndefInt;
  int minCTAs = kConfigUndefInt;
  int maxCTAs = kConfigUndefInt;
  const char* netName = nullptr;
  int splitShare = kConfigUndefInt;
};

// The functions, by their NCCL names.
struct Api {
  int version = 0;  // ncclGetVersion's code, e.g. 23206
  Result (*GetVersion)(int*);
  const char* (*GetErrorString)(Result);
  Result (*GetUniqueId)(UniqueId*);
  Result (*CommInitRankConfig)(Comm_t*, int, UniqueId, int, Config*);
  Result (*CommGetAsyncError)(Comm_t, Result*);
  Result (*CommAbort)(Comm_t);
  Result (*CommDestroy)(Comm_t);
  Result (*GroupStart)();
  Result (*GroupEnd)();
  Result (*AllReduce)(const void*, void*, size_t, DataType, RedOp, Comm_t, cudaStream_t);
  Result (*AllGather)(const void*, void*, size_t, DataType, Comm_t, cudaStream_t);
  Result (*Broadcast)(const void*, void*, size_t, DataType, int, Comm_t, cudaStream_t);
  Result (*Send)(const void*, size_t, DataType, int, Comm_t, cudaStream_t);
  Result (*Recv)(void*, size_t, DataType, int, Comm_t, cudaStream_t);
};

// Loads NCCL from `path` once per process (later calls return the same table, whatever path
// they name). Null with `error` set if the library or one of the functions is missing.
const Api* Load(const std::string& path, std::string* error);

// The loaded table, or null before a successful Load.
const Api* Loaded();

}  // namespace nccl
}  // namespace trainspec
