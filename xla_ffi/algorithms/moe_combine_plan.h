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
// The runtime runs these (algorithms/moe.cc; in strata mode the host fuses
// each partial into the sum that reads it) and the model times them.
#pragma once
#include <cstdint>
#include <vector>

#include "../runtime/moe_shape.h"
#include "../runtime/plan.h"
#include "../runtime/status.h"
#include "moe_plan.h"

namespace strata {

// A kept pair as the builder groups a token's pairs: its owner, its row
// there, its k.
struct MoeGroupedPair {
  int32_t owner, row, k;
};

struct MoeCombinePlans {
  Plan partials;  // input: each rank's expert rows; output: its scratch
  Plan sums;      // input: expert rows, scratch blocks past them; output: y
  // Per rank: its first transfer in `partials`; the one writing its scratch
  // block j is first_partial[r] + j.
  std::vector<uint32_t> first_partial;
  // The builder's scratch, kept with the plans (the runtime pools them): per
  // rank, its tokens' kept pairs grouped by owner (topk entries per token)
  // and their numbers, so Fill does not group them again.
  std::vector<std::vector<MoeGroupedPair>> grouped;
  std::vector<std::vector<int32_t>> grouped_count;
};

// BuildMoeCombinePlans in steps that may run in parallel (the runtime runs
// them as phases): Count(r) for every rank (reads only rank r's slots), then
// Layout (serial: reports a bad slot, places every rank's share of the
// plans), then Fill(r) for every rank (writes only rank r's share). The same
// plans as the serial build.
class MoeCombinePlanBuilder {
 public:
  // Builds into *plans (which must outlive the steps).
  MoeCombinePlanBuilder(const MoeOpShape& p, bool stage_all, MoeCombinePlans* plans);
  void Count(int r, const int32_t* pair_slot);
  Status Layout();
  // weights: rank r's (as below), or nullptr for all 1.
  void Fill(int r, const void* weights) const;

 private:
  using Pair = MoeGroupedPair;
  // Token t's kept pairs by owner (ascending; k ascending within one) into
  // `kept`, their number into *count; false on a bad slot.
  bool Group(const int32_t* pair_slot, int64_t t, Pair* kept, int64_t* count) const;

  MoeOpShape p_;
  bool stage_all_;
  MoeCombinePlans* plans_;
  int64_t per_rank_, slots_;
  OwnerOf owner_of_;  // slot / per_rank_: a 64-bit divide per pair was most of the build
  // Per rank: its sums' transfers and refs, its first bad pair (or -1) and slot.
  std::vector<int64_t> sum_transfers_, sum_refs_, bad_pair_, bad_slot_;
  // Per (rank r, owner o), r * n + o: partials r's tokens make on o and
  // their refs; after Layout, where r's first such partial and ref go.
  std::vector<int64_t> partials_, partial_refs_;
  std::vector<int64_t> sum_start_, sum_ref_start_;  // per rank, after Layout
};

// pair_slot[r][t * topk + k]: rank r's pair (t, k)'s global slot, or -1
// (algorithms/moe.h's layout). weights[r]: rank r's [tokens * topk] weights
// (float32; float64 for F64 rows), or empty for all (every weight 1: the
// model, which times bytes). A slot outside [-1, num_experts * capacity) is
// an error; the plans are unpartitioned.
Status BuildMoeCombinePlans(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                            const std::vector<const void*>& weights, bool stage_all, MoeCombinePlans* plans);

}  // namespace strata
