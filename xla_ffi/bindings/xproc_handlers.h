#pragma once
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

// Marks around the cross-process part of a strata op (xproc_handlers.cc).
extern "C" {
XLA_FFI_Error* StrataXprocMark(XLA_FFI_CallFrame* call_frame);
// Before a cross-process step: every process of the step must run the same
// op (op, reduction, dtype, shape, group: one hash each, all-gathered by XLA
// over the crossing axes); an error naming the disagreeing processes otherwise.
XLA_FFI_Error* StrataXprocCheck(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* StrataXprocHash(XLA_FFI_CallFrame* call_frame);
}

namespace strata {
// xproc_inflight(): what the monitor (stratacl_jax/_multiprocess/) reads.
void BindXproc(nanobind::module_& m);
}  // namespace strata
