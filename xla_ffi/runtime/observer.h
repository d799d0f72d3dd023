// Who hears of every op a rank runs: the runtime reports each op's start and
// end to the installed observer, if any. Tracing implements it
// (model/trace_log.h) and the bindings install it, so the runtime reports
// without depending on the layer that listens. With none installed (the
// default) an op pays one atomic load.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "collective.h"
#include "dtypes.h"
#include "moe_shape.h"
#include "rendezvous.h"
#include "status.h"

namespace strata {

// What the observed op is. The values are the trace records' "kind".
enum class ObservedOp : int32_t {
  kCollective = 0, kMoeDispatch = 1, kMoeCombine = 2, kMoeCombineBackward = 3, kRaggedAllToAll = 4,
};

// A ragged exchange's rank as it arrives: what it sends where, read as int64
// (group_size * slices_per_peer entries each; entry i goes to rank
// i / slices_per_peer). With every rank's, its plan can be built again
// (receivers' recv_sizes equal the senders' sizes once the op succeeded).
struct RaggedRankSizes {
  int32_t slices_per_peer = 1;
  std::vector<int64_t> input_offsets, send_sizes, output_offsets;
};

using OpDone = std::function<void(const Status&)>;

class OpObserver {
 public:
  virtual ~OpObserver() = default;
  // A rank arrives at a collective: returns `done` wrapped to hear of the
  // op's end for this rank (the wrapper must call `done` exactly once).
  virtual OpDone OnCollective(const OpParams& p, const CallSite& c, OpDone done) = 0;
  // The same for an MoE op. `routing` (the rank's pair_slot, `routing_count`
  // entries) is valid now, or only when the op has succeeded if
  // `read_at_end` (an output the op fills).
  virtual OpDone OnMoe(ObservedOp kind, const MoeOpShape& p, const CallSite& c, const int32_t* routing,
                       int64_t routing_count, bool read_at_end, OpDone done) = 0;
  // The same for ragged_all_to_all: `p` as the runtime runs its plan (blocks
  // are rows: in_blocks operand rows, out_blocks output rows, block_bytes a
  // row's bytes) and this rank's sizes.
  virtual OpDone OnRagged(const OpParams& p, RaggedRankSizes sizes, const CallSite& c, OpDone done) = 0;
};

// The installed observer, or nullptr.
OpObserver* ActiveObserver();
// Installs `observer` (nullptr: none); it must outlive every op that may
// still report to it (in practice: never destroyed).
void SetObserver(OpObserver* observer);

}  // namespace strata
