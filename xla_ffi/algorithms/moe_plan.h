// MoE dispatch as a transfer plan, in the collectives' vocabulary: what the
// runtime executes (algorithms/moe.cc, through runtime/collective.h PlanJob)
// and what the supernode model times (model_bindings, model.cc PlanProgram),
// built from the same data: every rank's pair slots.
//
// Blocks are rows: a rank's input is its x [tokens, hidden] (a block per
// token), its output its experts' rows [E_local * capacity, hidden] (a block
// per row). By DeepEP's traffic rule a token crosses to a rank once: its
// kept pair of lowest k there leads, and the transfer carries the token's x
// row to the lead's row and, on that rank, to the rows of the token's other
// experts there (destinations after the first on one rank: local copies).
// Rows nobody fills are zeroed: a run of them is one transfer without
// sources. A run of leads without fan-out from consecutive tokens of one
// rank into consecutive rows is one transfer spanning them.
#pragma once
#include <cstdint>
#include <vector>

#include "../runtime/collective.h"
#include "../runtime/moe_shape.h"
#include "../runtime/plan.h"
#include "../runtime/status.h"

namespace strata {

// pair_slot[r][t * topk + k]: the global slot (expert * capacity + row) of
// rank r's pair (t, k), or -1 if dropped (algorithms/moe.h's layout). A slot
// outside [-1, num_experts * capacity) or filled twice is an error.
Status BuildMoeDispatchPlan(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot, Plan* plan);

// The parameters the runtime runs that plan with (PlanJob; the model's
// PlanProgram and traces the same).
OpParams MoeDispatchRunParams(const MoeOpShape& p);

}  // namespace strata
