// Element types and the reduction kernels the cores run.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace strata {

enum class DType : int32_t { F32, F64, F16, BF16, S8, S32, S64, U8, U32, PRED, C64, C128 };
inline constexpr int32_t kDTypeCount = static_cast<int32_t>(DType::C128) + 1;
enum class ReduceOp : int32_t { kSum = 0, kMax = 1, kMin = 2, kProd = 3, kNone = 4 };
inline constexpr int32_t kReduceOpCount = static_cast<int32_t>(ReduceOp::kNone) + 1;

size_t DTypeSize(DType t);
bool IsComplex(DType t);
const char* DTypeName(DType t);
const char* ReduceOpName(ReduceOp op);

// outs[d][i] = reduce_{k < num_srcs} srcs[k][i] for i < count and every d.
// Sources fold in rank order and one executor writes every copy, so all
// ranks get the same bits. 16-bit floats accumulate in float32 and round once.
// Complex numbers: sum and prod only (they have no order); a product is the
// plain (ac - bd, ad + bc), each product rounded. (XLA:CPU fuses that into
// FMAs on hosts that have them, so a complex product can differ from lax's in
// the last bit there; tests/test_reduce_isa.py.)
// `streaming`: write the outputs with non-temporal stores (see CopyBytes).
// The kernels are compiled once per instruction set and one is chosen at
// load time (reduce_isa.h); every variant gives the same bits.
void ReduceInto(DType dtype, ReduceOp op, void* const* outs, int num_outs,
                const void* const* srcs, int num_srcs, size_t count, bool streaming = false);

}  // namespace strata
