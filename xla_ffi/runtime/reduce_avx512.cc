// The reduction kernels for the avx512 variant: reduce_kernels.inc compiled with
// this file's flags from CMakeLists.txt (-mavx512f -mavx512bw -mavx512vl -mavx512dq -ffp-contract=off).
#include <cstddef>
#include <cstdint>
#include <cstring>

// GCC 12 warns -Wmaybe-uninitialized inside its own AVX-512 headers, on the
// _mm512_undefined_* placeholders their intrinsics start from (a false
// positive): not for this file's code, so not shown.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>  // the bfloat16 kernels (reduce_kernels.inc)

#include "copy.h"
#include "reduce_isa.h"

namespace strata {
namespace isa_avx512 {
namespace {
#include "reduce_kernels.inc"
}  // namespace

void ReduceInto(DType dtype, ReduceOp op, void* const* outs, int num_outs, const void* const* srcs,
                int num_srcs, size_t count, bool streaming) {
  ReduceIntoImpl(dtype, op, outs, num_outs, srcs, num_srcs, count, streaming);
}

void AxpyRow(DType dtype, void* acc, const void* row, double w, int64_t n) {
  AxpyRowImpl(dtype, acc, row, w, n);
}

void AxpyAddRoundedRow(DType dtype, void* acc, const void* part, const void* row, double w, int64_t n) {
  AxpyAddRoundedRowImpl(dtype, acc, part, row, w, n);
}

void NarrowRow(DType dtype, void* out, const void* acc, int64_t n) { NarrowRowImpl(dtype, out, acc, n); }

void ScaleRow(DType dtype, void* out, const void* row, double w, int64_t n) { ScaleRowImpl(dtype, out, row, w, n); }

void StartSumRow(DType dtype, void* acc, const void* row, double w, int64_t n) { StartSumRowImpl(dtype, acc, row, w, n); }

double DotRow(DType dtype, const void* a, const void* b, int64_t n) { return DotRowImpl(dtype, a, b, n); }

}  // namespace isa_avx512
}  // namespace strata

#pragma GCC diagnostic pop
