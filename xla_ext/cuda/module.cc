// The CUDA nanobind module: a table of FFI handler capsules for platform "CUDA", registered with
// jax by trainspec/jax/xla_ext.py only where jax has a GPU backend (so a CPU-only process never
// imports it), and the NCCL setup that trainspec/jax/collectives/nccl.py drives. No handler
// logic lives here.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_handlers.h"
#include "nccl_comms.h"

namespace nb = nanobind;
namespace nccl = trainspec::nccl;

namespace {

nb::capsule Capsule(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

const nccl::Api& Nccl() {
  const nccl::Api* api = nccl::Loaded();
  if (api == nullptr) throw std::runtime_error("NCCL is not loaded: call nccl_load first");
  return *api;
}

}  // namespace

NB_MODULE(_xla_ext_cuda, m) {
  m.def("registrations", []() {
    nb::dict table;
    table["trainspec_fingerprint"] = Capsule(TrainspecFingerprintCuda);
    table["trainspec_quantize"] = Capsule(TrainspecQuantizeCuda);
    table["trainspec_dequantize"] = Capsule(TrainspecDequantizeCuda);
    table["trainspec_error_feedback"] = Capsule(TrainspecErrorFeedbackCuda);
    table["trainspec_all_reduce"] = Capsule(TrainspecAllReduceCuda);
    table["trainspec_reduce_scatter"] = Capsule(TrainspecReduceScatterCuda);
    table["trainspec_all_gather"] = Capsule(TrainspecAllGatherCuda);
    table["trainspec_all_to_all"] = Capsule(TrainspecAllToAllCuda);
    table["trainspec_broadcast"] = Capsule(TrainspecBroadcastCuda);
    table["trainspec_permute"] = Capsule(TrainspecPermuteCuda);
    return table;
  });
  // What the handlers were compiled against, as _xla_ext.build_info() says it for the CPU ones.
  m.def("build_info", []() {
    nb::dict info;
    info["xla_ffi_api"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
    info["jaxlib"] = TRAINSPEC_JAXLIB_VERSION;
    info["cuda_runtime"] = CUDART_VERSION;
    return info;
  });
  // NCCL: load the library (returns its version code), make a group's unique id (rank 0's
  // process), create a communicator for this process's members of one group, forget them all.
  m.def("nccl_load", [](const std::string& path) {
    std::string error;
    const nccl::Api* api = nccl::Load(path, &error);
    if (api == nullptr) throw std::runtime_error(error);
    return api->version;
  });
  m.def("nccl_unique_id", []() {
    nccl::UniqueId id;
    if (const std::string e = nccl::Failed("ncclGetUniqueId", Nccl().GetUniqueId(&id));
        !e.empty()) {
      throw std::runtime_error(e);
    }
    return nb::bytes(id.internal, sizeof(id.internal));
  });
  m.def("nccl_create",
        [](int64_t comm_id, const std::vector<std::tuple<int, int, int, nb::bytes>>& members,
           int64_t timeout_ms) {
          Nccl();
          std::vector<nccl::Member> parsed;
          for (const auto& [device, rank, nranks, id] : members) {
            if (id.size() != nccl::kUniqueIdBytes) throw std::invalid_argument("bad NCCL id");
            nccl::Member member{device, rank, nranks, {}};
            std::memcpy(member.id.internal, id.c_str(), nccl::kUniqueIdBytes);
            parsed.push_back(member);
          }
          if (const std::string e = nccl::Create(comm_id, parsed, timeout_ms); !e.empty()) {
            throw std::runtime_error(e);
          }
        });
  m.def("nccl_destroy_all", &nccl::DestroyAll);
}
