// MoE dispatch as a transfer plan, in the collectives' vocabulary: what the
// runtime executes (algorithms/moe.cc: in strata mode each owner's plan as
// it is, through runtime/collective.h OrderedPlanPhase; in buffer_centric
// the joined plan, through PlanJob) and what the supernode model times
// (model_bindings, model.cc PlanProgram), built from the same data: every
// rank's pair slots.
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

// slot / per_rank for 0 <= slot < 2^31 without a divide: q = (slot * m) >>
// (31 + L), m = ceil(2^(31+L) / d), L = ceil(log2 d), exact for such slots
// (m * d - 2^(31+L) < d <= 2^L: Granlund and Montgomery's round-up method).
class OwnerOf {
 public:
  explicit OwnerOf(int64_t d) : shift_(31 + CeilLog2(d)), magic_(((uint64_t{1} << shift_) + d - 1) / d) {}
  int32_t operator()(int32_t slot) const { return static_cast<int32_t>((static_cast<uint64_t>(slot) * magic_) >> shift_); }

 private:
  static int CeilLog2(int64_t d) {
    int l = 0;
    while ((int64_t{1} << l) < d) ++l;
    return l;
  }
  int shift_;
  uint64_t magic_;
};

// pair_slot[r][t * topk + k]: the global slot (expert * capacity + row) of
// rank r's pair (t, k), or -1 if dropped (algorithms/moe.h's layout). A slot
// outside [-1, num_experts * capacity) or filled twice is an error.
Status BuildMoeDispatchPlan(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot, Plan* plan);

// BuildMoeDispatchPlan in steps that may run in parallel (the runtime runs
// them as phases: its serial build was most of a small dispatch's time):
// Sources(r) for every rank (reads only rank r's slots; may run as soon as
// they are final), then Owner(o) for every rank (writes only rank o's
// rows' transfers), then Finish, which reports bad slots as the serial walk
// does and joins the owners' transfers in owner order (the same plan).
// Strata mode runs the owners' plans as they are instead (OwnerPlan, each
// the group's plan's transfers writing rank o's rows, refs its own, the
// group plan's shape): CheckSlots is Finish's report without the join.
class MoeDispatchPlanBuilder {
 public:
  MoeDispatchPlanBuilder() = default;
  explicit MoeDispatchPlanBuilder(const MoeOpShape& p) { Reset(p); }
  // For the shape's op, as if new (a pooled builder keeps its lists' storage:
  // fresh ones each op were a tenth of a dispatch in malloc and free).
  void Reset(const MoeOpShape& p);
  int64_t CapacityBytes() const;  // what a pool keeps alive
  void Sources(int r, const int32_t* pair_slot);
  // False, with rank o's plan empty, when some rank's slots were bad.
  bool Owner(int32_t owner);
  const Plan& OwnerPlan(int32_t owner) const { return owners_[owner]; }
  Status CheckSlots(const std::vector<const int32_t*>& pair_slot) const;
  Status Finish(const std::vector<const int32_t*>& pair_slot, Plan* plan);
  // After every Sources: the busiest rank's bytes read + written by the
  // plan (what PlanMovesOnSdma walks the plan for), from the ranks' leads.
  int64_t BusiestRankBytes() const;

 private:
  void Header(Plan* plan) const;  // the group plan's shape, no transfers
  MoeOpShape p_;
  int64_t per_rank_ = 0, slots_ = 0;
  // Per global slot: the group token filling it (rank x tokens + token; -1:
  // empty; one array, not a rank's and a token's: the owners read what the
  // placing ranks wrote, a cache line from another core per 16 slots); -1
  // if it leads its token on its rank, else the lead's slot; the next of a
  // lead's followers (a lead's entry: its first), ascending. No division
  // per slot or pair (a 64-bit divide each was most of the build): owners
  // and ranks come from reciprocals, rows from nested loops.
  std::vector<int32_t> src_, lead_, next_;
  std::vector<Plan> owners_;  // each owner's transfers, refs local to it
  std::vector<int64_t> leads_;  // per rank: its tokens' leads (rows it sends)
  std::vector<int64_t> kept_;   // per rank: its kept pairs
  std::vector<int64_t> filled_;  // per owner: its filled rows (-1: a follower without its lead)
  std::vector<uint8_t> bad_;  // per rank: a slot outside the range
};

// The parameters the runtime runs that plan with (PlanJob; the model's
// PlanProgram and traces the same).
OpParams MoeDispatchRunParams(const MoeOpShape& p);

}  // namespace strata
