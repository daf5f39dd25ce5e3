// Handler symbols of every xla_ext family, exported as capsules by module.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(TrainspecFingerprint);
