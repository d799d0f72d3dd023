// ragged_all_to_all (lax.ragged_all_to_all's semantics): rank s sends rows
// [input_offsets_s[d], + send_sizes_s[d]) of its operand to rank d, which
// receives them at rows [output_offsets_s[d], + send_sizes_s[d]) of its output
// (offsets in the receiver's buffer, chosen by the sender); rows nobody writes
// keep the output's values. With k slices per peer, entry i goes to rank
// i / k, and the receiver's recv_sizes[s * k + j] is sender s's j-th. Sizes are runtime values: every rank publishes its
// offset/size vectors and the last rank to arrive reads them all, checks them
// and copies the rows straight between the ranks' buffers.
#pragma once
#include <cstdint>
#include <functional>

#include "../runtime/dtypes.h"
#include "../runtime/rendezvous.h"
#include "../runtime/status.h"

namespace strata {

// The integer type of an offsets/sizes vector, as given (lax takes any
// integer type; a narrowing cast would wrap values that do not fit).
enum class IndexType : int32_t { S32 = 0, S64 = 1, U32 = 2, U64 = 3 };

struct RaggedParams {
  int32_t group_size = 1;
  int32_t slices_per_peer = 1;  // offsets/sizes hold group_size * slices_per_peer entries
  int64_t operand_rows = 0, output_rows = 0, row_bytes = 0;
  DType dtype = DType::F32;
  // input_offsets, send_sizes, output_offsets, recv_sizes
  IndexType index_types[4] = {IndexType::S32, IndexType::S32, IndexType::S32, IndexType::S32};
};

// Below this many bytes copied for the whole group, the last rank in copies on
// the spot: handing the work to the host workers would cost more.
constexpr int64_t kRaggedInlineGroupBytes = 256 << 10;

// One rank's buffers. `out` already holds the output operand's values.
struct RaggedBuffers {
  const void* operand = nullptr;
  void* out = nullptr;
  // [group_size * slices_per_peer] each, of RaggedParams::index_types.
  const void* input_offsets = nullptr;
  const void* send_sizes = nullptr;
  const void* output_offsets = nullptr;  // in each receiver's output
  const void* recv_sizes = nullptr;
};

// Joins the group and returns at once; `done` runs once, when every rank's
// rows have arrived (or with the error every rank gets).
void RaggedAllToAllAsync(const RaggedParams& p, const CallSite& c, const RaggedBuffers& b,
                         std::function<void(const Status&)> done);

}  // namespace strata
