// The CUDA nanobind module: a table of FFI handler capsules for platform "CUDA", registered with
// jax by trainspec/jax/xla_ext.py only where jax has a GPU backend (so a CPU-only process never
// imports it). No handler logic lives here.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>

#include "cuda_handlers.h"

namespace nb = nanobind;

NB_MODULE(_xla_ext_cuda, m) {
  m.def("registrations", []() {
    nb::dict table;
    table["trainspec_fingerprint"] = nb::capsule(reinterpret_cast<void*>(TrainspecFingerprintCuda));
    table["trainspec_quantize"] = nb::capsule(reinterpret_cast<void*>(TrainspecQuantizeCuda));
    table["trainspec_dequantize"] = nb::capsule(reinterpret_cast<void*>(TrainspecDequantizeCuda));
    table["trainspec_error_feedback"] =
        nb::capsule(reinterpret_cast<void*>(TrainspecErrorFeedbackCuda));
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
}
