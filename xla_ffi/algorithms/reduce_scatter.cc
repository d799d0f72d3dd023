// reduce_scatter: block d of every input folds into rank d's output; rank d
// reduces its own block by reading its peers' buffers directly.
#include "algorithms.h"

namespace strata {

void BuildReduceScatterPlan(const OpParams& p, Plan& plan) {
  for (int d = 0; d < p.group_size; ++d) {
    std::vector<BlockRef> srcs;
    for (int s = 0; s < p.group_size; ++s) srcs.push_back({s, d});
    plan.Add(srcs, {{d, 0}});
  }
}

}  // namespace strata
