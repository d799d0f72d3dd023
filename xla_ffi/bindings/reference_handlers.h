#pragma once
#include "xla/ffi/api/c_api.h"

// Floor references for the latency benchmark (reference_handlers.cc).
extern "C" {
XLA_FFI_Error* StrataRefCopy(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* StrataRefBarrier(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* StrataRefMeet(XLA_FFI_CallFrame* call_frame);
}
