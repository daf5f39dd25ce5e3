// Handler symbols of the CUDA module (_xla_ext_cuda), exported as capsules by cuda/module.cc and
// registered by trainspec/jax/xla_ext.py for platform "CUDA" under the same target names as the
// CPU handlers of handlers.h.
#pragma once

#include "xla/ffi/api/ffi.h"

// cuda/handlers.cc: the memory-layout and compression kernels on XLA's stream.
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecFingerprintCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecQuantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecDequantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecErrorFeedbackCuda);

// cuda/nccl_handlers.cc: the ext collectives through NCCL.
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecAllReduceCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecReduceScatterCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecAllGatherCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecAllToAllCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecBroadcastCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecPermuteCuda);
