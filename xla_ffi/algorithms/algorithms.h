// One file per collective; each turns an op into a transfer plan over the
// normalised [rows, blocks, block_bytes] layout (see runtime/plan.h).
// The plans differ only in which blocks meet: the engine that runs them,
// the lane partitioning and both communication modes are shared.
#pragma once
#include "../runtime/collective.h"
#include "../runtime/plan.h"

namespace strata {

void BuildAllReducePlan(const OpParams& p, Plan& plan);
void BuildAllGatherPlan(const OpParams& p, Plan& plan);
void BuildReduceScatterPlan(const OpParams& p, Plan& plan);
void BuildAllToAllPlan(const OpParams& p, Plan& plan);
void BuildBroadcastPlan(const OpParams& p, Plan& plan);
void BuildPermutePlan(const OpParams& p, Plan& plan);

// Block counts of each rank's input and output for an op over n ranks.
void BlockCounts(OpKind kind, int n, int64_t* in_blocks, int64_t* out_blocks);

}  // namespace strata
