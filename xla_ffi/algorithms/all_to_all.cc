// all_to_all: block d of rank s goes to block s of rank d; each destination
// pulls its N blocks straight from the sources' buffers.
#include "algorithms.h"

namespace strata {

void BuildAllToAllPlan(const OpParams& p, Plan& plan) {
  for (int d = 0; d < p.group_size; ++d)
    for (int s = 0; s < p.group_size; ++s) plan.Add({{s, d}}, {{d, s}});
}

}  // namespace strata
