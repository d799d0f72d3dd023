#pragma once
#include "xla/ffi/api/c_api.h"

// XLA FFI handler symbols of MoE dispatch/combine, registered for platform "cpu".
extern "C" {
XLA_FFI_Error* StrataMoeDispatch(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* StrataMoeCombine(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* StrataMoeCombineBackward(XLA_FFI_CallFrame* call_frame);
}
