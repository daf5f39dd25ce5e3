// Run-time loading of NCCL (nccl_api.h).
#include "nccl_api.h"

#include <dlfcn.h>

#include <mutex>

#if defined(TRAINSPEC_HAVE_NCCL_H)
#include <nccl.h>

#include <cstddef>

// Every declaration of nccl_api.h against the real header.
namespace {
namespace n = trainspec::nccl;
static_assert(n::kUniqueIdBytes == NCCL_UNIQUE_ID_BYTES);
#define TRAINSPEC_SAME_VALUE(ours, theirs) \
  static_assert(static_cast<int>(n::ours) == static_cast<int>(theirs), #ours)
TRAINSPEC_SAME_VALUE(kSuccess, ncclSuccess);
TRAINSPEC_SAME_VALUE(kInProgress, ncclInProgress);
TRAINSPEC_SAME_VALUE(kSum, ncclSum);
TRAINSPEC_SAME_VALUE(kMax, ncclMax);
TRAINSPEC_SAME_VALUE(kMin, ncclMin);
TRAINSPEC_SAME_VALUE(kAvg, ncclAvg);
TRAINSPEC_SAME_VALUE(kInt8, ncclInt8);
TRAINSPEC_SAME_VALUE(kUint8, ncclUint8);
TRAINSPEC_SAME_VALUE(kInt32, ncclInt32);
TRAINSPEC_SAME_VALUE(kFloat16, ncclFloat16);
TRAINSPEC_SAME_VALUE(kFloat32, ncclFloat32);
TRAINSPEC_SAME_VALUE(kFloat64, ncclFloat64);
TRAINSPEC_SAME_VALUE(kBfloat16, ncclBfloat16);
#undef TRAINSPEC_SAME_VALUE
static_assert(n::kConfigMagic == NCCL_API_MAGIC && n::kConfigUndefInt == NCCL_CONFIG_UNDEF_INT);
#define TRAINSPEC_SAME_OFFSET(field) \
  static_assert(offsetof(n::Config, field) == offsetof(ncclConfig_t, field), #field)
TRAINSPEC_SAME_OFFSET(size);
TRAINSPEC_SAME_OFFSET(magic);
TRAINSPEC_SAME_OFFSET(version);
TRAINSPEC_SAME_OFFSET(blocking);
TRAINSPEC_SAME_OFFSET(cgaClusterSize);
TRAINSPEC_SAME_OFFSET(minCTAs);
TRAINSPEC_SAME_OFFSET(maxCTAs);
TRAINSPEC_SAME_OFFSET(netName);
TRAINSPEC_SAME_OFFSET(splitShare);
#undef TRAINSPEC_SAME_OFFSET
// The enums and the unique id are passed by value: the same sizes make the calls ABI-identical.
static_assert(sizeof(n::UniqueId) == sizeof(ncclUniqueId));
static_assert(sizeof(n::Result) == sizeof(ncclResult_t) &&
              sizeof(n::RedOp) == sizeof(ncclRedOp_t) &&
              sizeof(n::DataType) == sizeof(ncclDataType_t));
}  // namespace
#endif

namespace trainspec {
namespace nccl {
namespace {

std::mutex load_mutex;
const Api* loaded = nullptr;

template <typename F>
bool Resolve(void* lib, const char* name, F* fn, std::string* error) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr) *error = std::string("NCCL library has no ") + name;
  return *fn != nullptr;
}

}  // namespace

const Api* Load(const std::string& path, std::string* error) {
  std::lock_guard<std::mutex> lock(load_mutex);
  if (loaded) return loaded;
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    *error = std::string("cannot load NCCL from ") + path + ": " + dlerror();
    return nullptr;
  }
  static Api api;
  const bool ok =
      Resolve(lib, "ncclGetVersion", &api.GetVersion, error) &&
      Resolve(lib, "ncclGetErrorString", &api.GetErrorString, error) &&
      Resolve(lib, "ncclGetUniqueId", &api.GetUniqueId, error) &&
      Resolve(lib, "ncclCommInitRankConfig", &api.CommInitRankConfig, error) &&
      Resolve(lib, "ncclCommGetAsyncError", &api.CommGetAsyncError, error) &&
      Resolve(lib, "ncclCommAbort", &api.CommAbort, error) &&
      Resolve(lib, "ncclCommDestroy", &api.CommDestroy, error) &&
      Resolve(lib, "ncclGroupStart", &api.GroupStart, error) &&
      Resolve(lib, "ncclGroupEnd", &api.GroupEnd, error) &&
      Resolve(lib, "ncclAllReduce", &api.AllReduce, error) &&
      Resolve(lib, "ncclAllGather", &api.AllGather, error) &&
      Resolve(lib, "ncclBroadcast", &api.Broadcast, error) &&
      Resolve(lib, "ncclSend", &api.Send, error) && Resolve(lib, "ncclRecv", &api.Recv, error);
  if (!ok || api.GetVersion(&api.version) != kSuccess) {
    if (ok) *error = "ncclGetVersion failed";
    dlclose(lib);
    return nullptr;
  }
  loaded = &api;
  return loaded;
}

const Api* Loaded() {
  std::lock_guard<std::mutex> lock(load_mutex);
  return loaded;
}

}  // namespace nccl
}  // namespace trainspec
