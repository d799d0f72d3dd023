#pragma once
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

// Marks around the cross-process part of a strata op (xproc_handlers.cc).
extern "C" {
XLA_FFI_Error* StrataXprocMark(XLA_FFI_CallFrame* call_frame);
}

namespace strata {
// xproc_inflight(): what the monitor (stratacl_jax/_multiprocess.py) reads.
void BindXproc(nanobind::module_& m);
}  // namespace strata
