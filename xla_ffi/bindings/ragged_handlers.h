#pragma once
#include "xla/ffi/api/c_api.h"

// XLA FFI handler of strata.ragged_all_to_all, registered for platform "cpu".
extern "C" {
XLA_FFI_Error* StrataRaggedAllToAll(XLA_FFI_CallFrame* call_frame);
}
