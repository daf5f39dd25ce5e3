// The nanobind module: a table of FFI handler capsules, registered with jax by
// trainspec/jax/xla_ext.py. No handler logic lives here.
#include <nanobind/nanobind.h>

#include "handlers.h"
#include "reduce_kernels.h"
#include "rendezvous.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "an XLA FFI handler must have the signature XLA_FFI_Error*(XLA_FFI_CallFrame*)");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_xla_ext, m) {
  m.def("registrations", []() {
    nb::dict table;
    table["trainspec_fingerprint"] = Capsule(TrainspecFingerprint);
    table["trainspec_all_reduce"] = Capsule(TrainspecAllReduce);
    table["trainspec_reduce_scatter"] = Capsule(TrainspecReduceScatter);
    table["trainspec_all_gather"] = Capsule(TrainspecAllGather);
    table["trainspec_all_to_all"] = Capsule(TrainspecAllToAll);
    table["trainspec_broadcast"] = Capsule(TrainspecBroadcast);
    table["trainspec_permute"] = Capsule(TrainspecPermute);
    table["trainspec_quantize"] = Capsule(TrainspecQuantize);
    table["trainspec_dequantize"] = Capsule(TrainspecDequantize);
    table["trainspec_error_feedback"] = Capsule(TrainspecErrorFeedback);
    return table;
  });
  // What the handlers were compiled against; trainspec/jax/xla_ext.py compares it with the running
  // jaxlib before registering them.
  m.def("build_info", []() {
    nb::dict info;
    info["xla_ffi_api"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
    info["jaxlib"] = TRAINSPEC_JAXLIB_VERSION;
    return info;
  });
  // Debug aid for leak tests: rendezvous slots alive right now (0 when no collective runs).
  m.def("live_rendezvous_count", &trainspec::LiveRendezvousCount);
  // Which reduction kernel variant this process runs ("baseline", "avx2" or "avx512"): the
  // best the CPU supports, lowered by TRAINSPEC_XLA_EXT_ISA (reduce_kernels.h).
  m.def("active_isa", []() { return trainspec::IsaName(trainspec::ActiveIsa()); });
}
