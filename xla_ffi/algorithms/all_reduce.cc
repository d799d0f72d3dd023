// all_reduce: one transfer, every rank's block folded into every rank's
// output. The partitioner gives each rank 1/N of the columns to reduce and
// write to all N outputs (reduce-scatter and all-gather fused in one pass),
// so every input byte is read once and every output byte written once.
#include "algorithms.h"

namespace strata {

void BuildAllReducePlan(const OpParams& p, Plan& plan) {
  std::vector<BlockRef> all;
  for (int r = 0; r < p.group_size; ++r) all.push_back({r, 0});
  plan.Add(all, all);
}

}  // namespace strata
