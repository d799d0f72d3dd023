// MoE combine as two plans in the collectives' vocabulary, in the order the
// NPUs work (DeepEP's rule: a token's rows on one rank are summed there and
// one row crosses back):
//   partials, on the experts' ranks: per (token, rank) with two or more kept
//     pairs, the rank's expert rows weighted by the pairs' weights, k
//     ascending, summed into a block of the rank's scratch (rounded to the
//     rows' dtype: the row that crosses);
//   sums, on the tokens' ranks: per token, one source per rank holding its
//     pairs, ranks ascending: a lone pair's expert row weighted by its weight,
//     or the rank's partial (weight 1); rounded once into y. Tokens without
//     a kept pair are zeroed (a run of them is one transfer).
// With `stage_all` (buffer_centric) every (token, rank)'s row goes through the
// owner's scratch (its comm buffer), a lone row copied as it is and weighted
// where it is read. The order is algorithms/moe.h's (and moe.py's references).
//
// Each token rank's share of both plans depends on its own routing alone, so
// a rank builds it (BuildMoeCombineShare) in its own handler, before it joins
// its group: the runtime runs the shares' sums as they are in strata mode
// (algorithms/moe.cc; the host fuses each partial into the sum that reads
// it), and joins them into the group's plans (JoinMoeCombineShares) where the
// owners' numbering matters: buffer_centric's scratch, the partials' lanes.
// The model times the joined plans; the shares' sums are the joined sums
// rank by rank, so every NPU's lanes get the same pieces either way.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "../runtime/collective.h"
#include "../runtime/moe_shape.h"
#include "../runtime/plan.h"
#include "../runtime/status.h"

namespace strata {

struct MoeCombinePlans {
  Plan partials;  // input: each rank's expert rows; output: its scratch
  Plan sums;      // input: expert rows, scratch blocks past them; output: y
  // Per rank: its first transfer in `partials`; the one writing its scratch
  // block j is first_partial[r] + j.
  std::vector<uint32_t> first_partial;
  // Strata mode: the partials' lanes' credit (they run fused into the sums).
  LaneCredit partials_credit;
};

// Token rank r's share, numbered within itself: `sums` holds r's tokens'
// sums (y rows of r only), `partials` the partials r's tokens make, owner by
// owner; a sum reads r's j-th partial on owner o as scratch block
// in_blocks + j of o, which is partials transfer first_partial[o] + j (so a
// share runs fused on its own, PlanPhase's producer). Joined, the j-th
// becomes o's (partials of lower ranks on o) + j-th.
struct MoeCombineShare {
  Plan sums, partials;
  std::vector<uint32_t> first_partial;      // [n + 1]: r's partials on o are [first_partial[o], first_partial[o + 1])
  std::vector<uint32_t> first_partial_ref;  // [n + 1]: and their refs (sources, then the one destination)
  // Strata mode: the sums' lanes' credit, as the joined sums partitioned
  // have them on this rank's NPU (the share runs whole transfers).
  LaneCredit sums_credit;
  // The builder's scratch, kept with the share (the runtime pools shares):
  // each token's kept pairs grouped by owner (owner << 32 | k, ascending),
  // and their numbers.
  std::vector<uint64_t> grouped;
  std::vector<int32_t> grouped_count;
  // Bytes the share's arrays hold (what a pool keeps alive).
  int64_t CapacityBytes() const;
};

// Rank r's share from its pair slots (pair_slot[t * topk + k]: pair (t, k)'s
// global slot, or -1: algorithms/moe.h's layout) and weights (its
// [tokens * topk]; float32, float64 for F64 rows; nullptr: all 1, the model's,
// which times bytes). A slot outside [-1, num_experts * capacity) is an error
// naming rank r's pair. The share's plans are unpartitioned.
Status BuildMoeCombineShare(const MoeOpShape& p, bool stage_all, int r, const int32_t* pair_slot,
                            const void* weights, MoeCombineShare* share);

// The shares' sums run on the host as strata mode runs them: whole
// transfers in order, each partial they read summed from its owner's rows
// as it is read (the partials fused), a run of one share's tokens a task
// (about a host chunk of rows; `transfers_per_task` of its sums, if given).
// buffers: in, the expert rows; out, y. Credits nothing: the caller credits
// each share's sums_credit and the joined partials' lanes (CreditLanes).
Phase MoeCombineSharesPhase(const MoeOpShape& p, std::vector<std::shared_ptr<const MoeCombineShare>> shares,
                            const PlanBuffers& buffers, int64_t transfers_per_task = 0);

// The group's plans from every rank's share (shares[r]: rank r's, built with
// the same shape and stage_all), unpartitioned. Either plan alone: the other
// is left as it was (strata mode joins only the partials, whose lanes the
// runtime credits as the model's joined plan has them).
Status JoinMoeCombineShares(const MoeOpShape& p, const std::vector<const MoeCombineShare*>& shares,
                            MoeCombinePlans* plans, bool join_partials = true, bool join_sums = true);

// Both in one: the shares of every rank, joined. weights[r] as above, or
// empty for all 1.
Status BuildMoeCombinePlans(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                            const std::vector<const void*>& weights, bool stage_all, MoeCombinePlans* plans);

}  // namespace strata
