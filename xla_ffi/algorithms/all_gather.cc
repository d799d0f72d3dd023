// all_gather: source s's block lands in block s of every output. One
// transfer per source with N destinations: each rank copies 1/N of every
// source once and writes it to all N outputs, so each input byte is read
// once in total (a per-destination pull would read it N times).
#include "algorithms.h"

namespace strata {

void BuildAllGatherPlan(const OpParams& p, Plan& plan) {
  for (int s = 0; s < p.group_size; ++s) {
    std::vector<BlockRef> dsts;
    for (int d = 0; d < p.group_size; ++d) dsts.push_back({d, s});
    plan.Add({{s, 0}}, dsts);
  }
}

}  // namespace strata
