// broadcast: the root's block to every output. Each rank copies 1/N of it to
// all N outputs, so the root's buffer is read once and no rank is a hot spot.
#include "algorithms.h"

namespace strata {

void BuildBroadcastPlan(const OpParams& p, Plan& plan) {
  std::vector<BlockRef> all;
  for (int r = 0; r < p.group_size; ++r) all.push_back({r, 0});
  plan.Add({{p.root, 0}}, all);
}

}  // namespace strata
