// MoE combine's backward as three plans in the collectives' vocabulary
// (DeepEP's rule: ct_y crosses to an expert's rank once per token, however
// many of the token's pairs are there; only one value per pair comes back):
//   carry, a copy: per (token, owner rank) with kept pairs, the token's ct_y
//     row into a block of the owner's scratch (an owner's blocks in the
//     order of their tokens: ranks, then tokens ascending);
//   scale, on the owners (weighted, local): each of the owner's d_expert_y
//     rows, w x the carried row for a filled slot (token by token, in the
//     carry's order, so a carried row's readers follow one another), zero
//     for an empty one (a run of them is one transfer);
//   dots, on the owners (a dot plan): per kept pair, <carried row, expert
//     row> into the pair's d_weights value on its token's rank (in the same
//     order); a run of dropped pairs' values is zeroed there.
// The runtime runs them as the owners' shares (algorithms/moe.cc: scale and
// dots read each carried row where it comes from, the carry fused into
// them; buffer_centric from the comm buffers) and the model times them
// joined.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../runtime/collective.h"
#include "../runtime/moe_shape.h"
#include "../runtime/plan.h"
#include "../runtime/status.h"

namespace strata {

// One owner's share of the three plans: its carried rows, their scale into
// its rows and their dots with its expert rows, its empty rows zeroed and
// rank o's own dropped pairs' values zeroed. Everything in it runs on owner
// o's NPU, so a share partitioned alone is the joined plans' NPU o, lane for
// lane. It depends on o's own dispatch fields alone (a token's rows on o are
// found by their sources, r * tokens * topk + pair), so the runtime builds it
// in o's handler, before o joins; only the weights are peers' (the token
// ranks'), filled in at the rendezvous (FillMoeBackwardWeights).
struct MoeBackwardShare {
  Plan carry, scale, dots;
  // Per ref of `scale`: the pair whose weight it takes (its source, as in
  // slot_source), or -1.
  std::vector<int32_t> weight_source;
  // Per row of the owner: the index of its transfer in `scale` and in `dots`
  // (the same: the pairs' transfers come first in both, in their sources'
  // order), for a filled row; the first `pair_transfers` of each are the
  // pairs', the rest zero runs.
  std::vector<uint32_t> row_transfer;
  uint32_t pair_transfers = 0;
  // Bytes each rank reads + writes in `carry` (AddRankBytes): the carry's
  // lanes are chosen over the busiest rank's sum of every share's.
  std::vector<int64_t> carry_rank_bytes;
  // In strata mode, what each plan credits its NPU's lanes (the host runs
  // the shares in its own order, not by lanes: PartitionCredit, not Partition).
  LaneCredit carry_credit, scale_credit, dots_credit;
  // The build's scratch, kept with the share so a pooled share reuses it.
  std::vector<uint64_t> by_source;  // (source << 32 | row) of the filled rows, sorted
  std::vector<uint64_t> sort_scratch;
  int64_t CapacityBytes() const;
};

// Owner o's share from its own fields: pair_slot (its [tokens * topk]
// slots) and slot_source (its [local_experts * capacity] sources). A slot
// or source out of range is an error naming the op; whether the two agree
// across ranks is the caller's to check (it takes every rank's fields).
// The scale's weights are 1 until filled.
Status BuildMoeBackwardShare(const MoeOpShape& p, int o, const int32_t* pair_slot, const int32_t* slot_source,
                             MoeBackwardShare* share);

// The share's scale weights from the token ranks' weights (weights[r]:
// [tokens * topk], float32; float64 for F64 rows; empty: all 1).
void FillMoeBackwardWeights(const MoeOpShape& p, const std::vector<const void*>& weights, MoeBackwardShare* share);

// The carry's lanes as PlanMovesOnSdma would choose them for the joined carry.
bool MoeBackwardCarryOnSdma(const MoeOpShape& p, const std::vector<const MoeBackwardShare*>& shares,
                            double descriptor_us = kSdmaDescriptorUs, double sdma_gbps = kSdmaGbps);

// The owners' shares run on the host as strata mode runs them: a few
// tokens of one token rank a task (~4 host chunks of work), owner by owner
// within it (each owner's pairs of those tokens are one run of its
// transfers: its records stream, and the tokens' carried rows, read where
// they come from (ct_y), stay in cache from one owner to the next; lane by
// lane, owner by owner, each came from memory once per owner); then each
// owner's zero runs, a task each (OrderedPlanPhase). pair_slot[r]: rank r's
// slots, which must agree with the shares' sources (checked before). The
// buffers: the scale's out (d_expert_y) and producer_in (ct_y); the dots'
// in (expert rows), out (d_weights) and producer_in. Credits nothing: the
// caller credits the shares' lanes (CreditLanes).
Phase MoeBackwardSharesPhase(const MoeOpShape& p, std::vector<std::shared_ptr<const MoeBackwardShare>> shares,
                             std::vector<const int32_t*> pair_slot, const PlanBuffers& scale_buffers,
                             const PlanBuffers& dot_buffers);

struct MoeBackwardPlans {
  Plan carry;  // input: each rank's ct_y rows; output: its scratch
  Plan scale;  // scratch: the carried rows; output: d_expert_y
  Plan dots;   // input: expert rows, scratch blocks past them; output: d_weights values
  // Per rank: its first transfer in `carry`; the one writing its scratch
  // block j is first_carry[r] + j.
  std::vector<uint32_t> first_carry;
  // BuildMoeBackwardPlans' shares (the runtime's come from its handlers).
  std::vector<MoeBackwardShare> shares;
};

// Whether one dispatch's two fields describe one layout: every kept pair's
// slot names that pair as its source, and as many slots have a source as
// pairs have a slot (so every filled slot's source points back at it; in
// range is not enough: a row's gradient would go to a token that never sent
// it). "" if they do, else the first disagreement ("DispatchHandle fields
// disagree: ..."), for the caller to prefix with the op. The runtime checks
// this at its rendezvous before any plan runs; BuildMoeBackwardPlans too.
// pair_slot[r], slot_source[o] as below; a slot outside the group's is
// reported, not followed.
std::string MoeLayoutDisagreement(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                                  const std::vector<const int32_t*>& slot_source);

// pair_slot[r]: rank r's [tokens * topk] global slots (-1: dropped);
// slot_source[o]: owner o's [local_experts * capacity] source pairs
// (r * tokens * topk + pair, or -1: empty), the two fields of one dispatch
// (algorithms/moe.h). weights[r]: rank r's [tokens * topk] weights (float32;
// float64 for F64 rows), or empty for all 1 (the model, which times bytes).
// A slot or source out of range, or a slot whose source is not its pair, is
// an error naming the op. The plans are unpartitioned: the shares, filled
// and joined.
Status BuildMoeBackwardPlans(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                             const std::vector<const int32_t*>& slot_source,
                             const std::vector<const void*>& weights, MoeBackwardPlans* plans);

// The dispatch's slot_source from its pair_slot (each filled slot names its
// pair as r * tokens * topk + pair; -1 elsewhere): for callers that have
// only the slots (the model). A slot outside [-1, slots) is an error.
Status MoeSlotSources(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                      std::vector<std::vector<int32_t>>* slot_source);

// Partitions the three plans as the model times them (the runtime's shares
// credit the same lanes): the carry on SDMA engines or cores by the movement
// rule (MovesOnSdma over the busiest rank's bytes, with these figures),
// scale and dots on cores (dots cut only between products).
void PartitionMoeBackwardPlans(const MoeOpShape& p, MoeBackwardPlans* plans,
                               double descriptor_us = kSdmaDescriptorUs, double sdma_gbps = kSdmaGbps);

}  // namespace strata
