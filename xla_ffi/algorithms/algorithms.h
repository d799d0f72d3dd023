// One file per collective; each turns an op into a transfer plan over the
// normalised [rows, blocks, block_bytes] layout (see runtime/plan.h).
// The plans differ only in which blocks meet: the engine that runs them,
// the lane partitioning and both communication modes are shared.
// op_registry.cc names each builder with the rest of its op's identity.
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

}  // namespace strata
