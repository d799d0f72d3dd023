// The reduction kernels per instruction set, and which one ReduceInto uses.
//
// reduce_kernels.inc is compiled once per ISA (reduce_baseline.cc,
// reduce_avx2.cc, reduce_avx512.cc; CMakeLists.txt gives each its flags and
// defines STRATA_REDUCE_HAVE_<ISA> for the ones the compiler could build).
// At load time dtypes.cc picks the widest one the CPU reports
// (__builtin_cpu_supports), or the one STRATA_REDUCE_ISA names
// (baseline|avx2|avx512; an unknown or unavailable name keeps the automatic
// choice and leaves a note that the Python package turns into a warning).
// All variants give the same bits (see reduce_kernels.inc).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dtypes.h"

namespace strata {

using ReduceFn = void (*)(DType, ReduceOp, void* const*, int, const void* const*, int, size_t, bool);
using AxpyRowFn = void (*)(DType, void*, const void*, double, int64_t);
using AxpyAddRoundedRowFn = void (*)(DType, void*, const void*, const void*, double, int64_t);
using NarrowRowFn = void (*)(DType, void*, const void*, int64_t);
using ScaleRowFn = void (*)(DType, void*, const void*, double, int64_t);
using StartSumRowFn = void (*)(DType, void*, const void*, double, int64_t);
using DotRowFn = double (*)(DType, const void*, const void*, int64_t);

namespace isa_baseline {
void ReduceInto(DType, ReduceOp, void* const*, int, const void* const*, int, size_t, bool);
void AxpyRow(DType, void*, const void*, double, int64_t);
void AxpyAddRoundedRow(DType, void*, const void*, const void*, double, int64_t);
void NarrowRow(DType, void*, const void*, int64_t);
void ScaleRow(DType, void*, const void*, double, int64_t);
void StartSumRow(DType, void*, const void*, double, int64_t);
double DotRow(DType, const void*, const void*, int64_t);
}
namespace isa_avx2 {
void ReduceInto(DType, ReduceOp, void* const*, int, const void* const*, int, size_t, bool);
void AxpyRow(DType, void*, const void*, double, int64_t);
void AxpyAddRoundedRow(DType, void*, const void*, const void*, double, int64_t);
void NarrowRow(DType, void*, const void*, int64_t);
void ScaleRow(DType, void*, const void*, double, int64_t);
void StartSumRow(DType, void*, const void*, double, int64_t);
double DotRow(DType, const void*, const void*, int64_t);
}
namespace isa_avx512 {
void ReduceInto(DType, ReduceOp, void* const*, int, const void* const*, int, size_t, bool);
void AxpyRow(DType, void*, const void*, double, int64_t);
void AxpyAddRoundedRow(DType, void*, const void*, const void*, double, int64_t);
void NarrowRow(DType, void*, const void*, int64_t);
void ScaleRow(DType, void*, const void*, double, int64_t);
void StartSumRow(DType, void*, const void*, double, int64_t);
double DotRow(DType, const void*, const void*, int64_t);
}

// The MoE combine's accumulation of one weighted expert row in the chosen
// variant: acc[i] += w * row[i] for i < n, acc float32 (float64 for F64
// rows), rows F32/F64/F16/BF16, w the weight (a float, or a double for F64).
void AxpyRow(DType row_dtype, void* acc, const void* row, double w, int64_t n);
// Same, in a named variant (nullptr if unusable; for tests).
AxpyRowFn AxpyRowKernel(const std::string& isa);
// The MoE combine's partial sums cross ranks in the rows' dtype: acc[i] +=
// (part[i] + w * row[i]) narrowed to row_dtype (nearest even) and widened
// back, the partial's last pair and its rounding fused; acc and part
// float32 (float64 for F64 rows; then, as for F32, nothing is rounded).
void AxpyAddRoundedRow(DType row_dtype, void* acc, const void* part, const void* row, double w, int64_t n);
// The combine's finished sums stored as rows: out[i] = acc[i] rounded to
// row_dtype (nearest even, NaN quieted), for F32, F64 and BF16 rows (F16
// rows: the caller's own conversion, whose NaN payloads this one's would
// not keep).
void NarrowRow(DType row_dtype, void* out, const void* acc, int64_t n);

// MoE combine's backward, a d_expert_y row: out[i] = (0 + w * row[i])
// rounded to row_dtype, for F32, F64 and BF16 rows (F16 rows: AxpyRow and
// the caller's own conversion, as for NarrowRow).
void ScaleRow(DType row_dtype, void* out, const void* row, double w, int64_t n);
// A weighted sum's first row: acc[i] = 0 + w * row[i] in the accumulation
// type (as AxpyRow's acc), the same bits as zeroing acc and AxpyRow, one pass
// (MoE combine's sums and partials: a memset per row saved).
void StartSumRow(DType row_dtype, void* acc, const void* row, double w, int64_t n);
// MoE combine's backward, a d_weights value: the dot product of two rows
// (F32, F64, F16, BF16) in eight interleaved float32 partial sums (float64
// for F64 rows), the same bits in every variant.
double DotRow(DType row_dtype, const void* a, const void* b, int64_t n);

// The variant ReduceInto runs now: "baseline", "avx2" or "avx512".
const char* ReduceIsa();
// The variants this build has and this CPU runs, narrowest first.
std::vector<std::string> ReduceIsasAvailable();
// Every variant name, whether built and supported or not.
std::vector<std::string> ReduceIsasKnown();
// The kernel of a variant, or nullptr if it is unknown, not built or not
// supported by this CPU (for tests: run each variant side by side).
ReduceFn ReduceKernel(const std::string& isa);
// Makes `isa` the one ReduceInto runs ("auto": the load-time automatic
// choice). Returns "" on success, else why not (nothing changes). Ops read
// the choice per kernel call; every variant gives the same bits, so a
// switch during an op changes only its speed.
std::string SetReduceIsa(const std::string& isa);
// What happened to STRATA_REDUCE_ISA at load time if it could not be
// honoured ("" otherwise).
const std::string& ReduceIsaNote();

}  // namespace strata
