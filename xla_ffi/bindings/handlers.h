#pragma once
#include "xla/ffi/api/c_api.h"

// XLA FFI handler symbols, one per collective, registered for platform "cpu".
extern "C" {
XLA_FFI_Error* StrataAllReduce(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* StrataAllGather(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* StrataReduceScatter(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* StrataAllToAll(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* StrataBroadcast(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* StrataPermute(XLA_FFI_CallFrame* call_frame);
// The "instantiate" stage every strata target shares (a SiteInstance per
// custom-call instruction).
XLA_FFI_Error* StrataSiteInstantiate(XLA_FFI_CallFrame* call_frame);
}
