#pragma once
#include "../algorithms/op_registry.h"
#include "xla/ffi/api/c_api.h"

namespace strata {
// The XLA FFI handler of a fixed-plan collective, one per such registry
// entry (registered for platform "cpu" as "strata_<name>").
XLA_FFI_Handler* CollectiveHandler(OpKind kind);
}  // namespace strata

extern "C" {
// The "instantiate" stage every strata target shares (a SiteInstance per
// custom-call instruction).
XLA_FFI_Error* StrataSiteInstantiate(XLA_FFI_CallFrame* call_frame);
}
