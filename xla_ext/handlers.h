// Handler symbols of every xla_ext family, exported as capsules by module.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecFingerprint);

// collectives.cc: in-process collectives between the devices of one process (CPU).
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecAllGather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecAllToAll);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecBroadcast);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecPermute);

// compression.cc: the compressed gradient exchange's packed buffers (collectives.compression).
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecQuantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecDequantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecErrorFeedback);
