// ragged_all_to_all (lax.ragged_all_to_all's semantics): rank s sends rows
// [input_offsets_s[d], + send_sizes_s[d]) of its operand to rank d, which
// receives them at rows [output_offsets_s[d], + send_sizes_s[d]) of its output
// (offsets in the receiver's buffer, chosen by the sender); rows nobody writes
// keep the output's values. With k slices per peer, entry i goes to rank
// i / k, and the receiver's recv_sizes[s * k + j] is sender s's j-th. Sizes
// are runtime values: every rank publishes its offset/size vectors and the
// last rank to arrive reads them all, checks them and builds the exchange's
// plan (BuildRaggedPlan), which the runtime runs like a collective's, in
// either mode, on the NPUs' lanes (runtime/collective.h PlanJob).
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "../runtime/collective.h"
#include "../runtime/dtypes.h"
#include "../runtime/plan.h"
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
  // How it runs, as a collective's OpParams (strata.config).
  Mode mode = Mode::kStrata;
  int32_t cores = 1, engines = 1;
  Planner planner = Planner::kBalanced;
  int64_t comm_buffer_bytes = 200 << 20;
};

// One rank's offset/size vectors as it published them: input_offsets,
// send_sizes, output_offsets, recv_sizes, of RaggedParams::index_types.
using RaggedVectors = std::array<const void*, 4>;

// The exchange as a plan over blocks of one row (in_blocks = operand_rows,
// out_blocks = output_rows, block_bytes = row_bytes, rows = 1): each run of
// rows from a sender to a receiver is one transfer spanning its rows. The
// vectors are checked first (sizes agree with the receivers' recv_sizes,
// rows fit the buffers); the first bad entry is the error, naming the rank.
Status BuildRaggedPlan(const RaggedParams& p, const std::vector<RaggedVectors>& ranks, Plan* plan);

// The parameters the runtime runs that plan with (PlanJob; the model's
// PlanProgram and the trace record the same): blocks are rows.
OpParams RaggedRunParams(const RaggedParams& p);

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
