// MoE combine's backward as three plans in the collectives' vocabulary
// (DeepEP's rule: ct_y crosses to an expert's rank once per token, however
// many of the token's pairs are there; only one value per pair comes back):
//   carry, a copy: per (token, owner rank) with kept pairs, the token's ct_y
//     row into a block of the owner's scratch (an owner's blocks in the
//     order of the rows whose pair leads the token there: the lowest k);
//   scale, on the owners (weighted, local): each of the owner's d_expert_y
//     rows, w x the carried row for a filled slot (token by token, in the
//     carry's order, so a carried row's readers follow one another), zero
//     for an empty one (a run of them is one transfer);
//   dots, on the owners (a dot plan): per kept pair, <carried row, expert
//     row> into the pair's d_weights value on its token's rank (in the same
//     order); a run of dropped pairs' values is zeroed there.
// The runtime runs them (algorithms/moe.cc; in strata mode scale and dots
// read each carried row where it comes from, the carry fused into them) and
// the model times them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "../runtime/moe_shape.h"
#include "../runtime/plan.h"
#include "../runtime/status.h"

namespace strata {

struct MoeBackwardPlans {
  Plan carry;  // input: each rank's ct_y rows; output: its scratch
  Plan scale;  // scratch: the carried rows; output: d_expert_y
  Plan dots;   // input: expert rows, scratch blocks past them; output: d_weights values
  // Per rank: its first transfer in `carry`; the one writing its scratch
  // block j is first_carry[r] + j.
  std::vector<uint32_t> first_carry;
  // The builder's per-owner shares, kept with the plans (the runtime pools
  // them, so their arrays are reused op to op).
  struct Share {
    Plan carry, scale, dots;
    std::string error;
  };
  std::vector<Share> shares;
};

// BuildMoeBackwardPlans in steps that may run in parallel (the runtime runs
// them as phases): Owner(o) for every rank (writes only share o), then
// Layout (serial: the first error; places every share), then Join(o) for
// every rank (copies share o into the plans). The same plans as the serial
// build.
class MoeBackwardPlanBuilder {
 public:
  // Builds into *plans (which must outlive the steps), from the arrays below.
  MoeBackwardPlanBuilder(const MoeOpShape& p, std::vector<const int32_t*> pair_slot,
                         std::vector<const int32_t*> slot_source, std::vector<const void*> weights,
                         MoeBackwardPlans* plans);
  // Owner o's carried rows, its rows' scale and its pairs' dots, and rank
  // o's dropped pairs' zeroed values.
  void Owner(int o);
  Status Layout();
  void Join(int o);

 private:
  MoeOpShape p_;
  std::vector<const int32_t*> pair_slot_, slot_source_;
  std::vector<const void*> weights_;
  MoeBackwardPlans* plans_;
  // Per owner, after Layout: where its share's transfers and refs go in
  // each plan (carry, scale, dots).
  std::vector<uint32_t> transfer_at_[3], ref_at_[3];
};

// pair_slot[r]: rank r's [tokens * topk] global slots (-1: dropped);
// slot_source[o]: owner o's [local_experts * capacity] source pairs
// (r * tokens * topk + pair, or -1: empty), the two fields of one dispatch
// (algorithms/moe.h). weights[r]: rank r's [tokens * topk] weights (float32;
// float64 for F64 rows), or empty for all 1 (the model, which times bytes).
// A slot or source out of range, or a slot whose source is not its pair, is
// an error naming the op. The plans are unpartitioned.
Status BuildMoeBackwardPlans(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                             const std::vector<const int32_t*>& slot_source,
                             const std::vector<const void*>& weights, MoeBackwardPlans* plans);

// The dispatch's slot_source from its pair_slot (each filled slot names its
// pair as r * tokens * topk + pair; -1 elsewhere): for callers that have
// only the slots (the model). A slot outside [-1, slots) is an error.
Status MoeSlotSources(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                      std::vector<std::vector<int32_t>>* slot_source);

// Partitions plan `which` (0 carry, 1 scale, 2 dots) as the runtime and the
// model both run it: the carry on SDMA engines or cores by the movement rule
// (MovesOnSdma over the busiest rank's bytes, with these figures), scale
// and dots on cores (dots cut only between products). The three are
// independent (the runtime partitions them at once).
void PartitionMoeBackwardPlan(const MoeOpShape& p, MoeBackwardPlans* plans, int which,
                              double descriptor_us = kSdmaDescriptorUs, double sdma_gbps = kSdmaGbps);
// All three.
void PartitionMoeBackwardPlans(const MoeOpShape& p, MoeBackwardPlans* plans,
                               double descriptor_us = kSdmaDescriptorUs, double sdma_gbps = kSdmaGbps);

}  // namespace strata
