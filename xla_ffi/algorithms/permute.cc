// ppermute: each (source, destination) pair is one copy; ranks that receive
// nothing get zeros, as lax.ppermute gives them.
#include "algorithms.h"

namespace strata {

void BuildPermutePlan(const OpParams& p, Plan& plan) {
  std::vector<bool> receives(p.group_size, false);
  for (size_t i = 0; i + 1 < p.perm.size(); i += 2) {
    plan.Add({{p.perm[i], 0}}, {{p.perm[i + 1], 0}});
    receives[p.perm[i + 1]] = true;
  }
  for (int d = 0; d < p.group_size; ++d)
    if (!receives[d]) plan.Add({}, {{d, 0}});
}

}  // namespace strata
