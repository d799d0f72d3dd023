#include "moe_combine_plan.h"

#include <algorithm>
#include <sstream>
#include <string>

namespace strata {

namespace {
constexpr const char* kName = "strata.moe.combine";

// Rank r's weight of pair i (1 without weights).
double WeightOf(const std::vector<const void*>& weights, DType dtype, int r, int64_t i) {
  if (weights.empty()) return 1.0;
  if (dtype == DType::F64) return static_cast<const double*>(weights[r])[i];
  return static_cast<double>(static_cast<const float*>(weights[r])[i]);
}
}  // namespace

Status BuildMoeCombinePlans(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                            const std::vector<const void*>& weights, bool stage_all, MoeCombinePlans* plans) {
  const int n = p.group_size;
  if (static_cast<int>(pair_slot.size()) != n || (!weights.empty() && static_cast<int>(weights.size()) != n))
    return Status::Error(std::string(kName) + ": " + std::to_string(pair_slot.size()) +
                         " ranks' slots for a group of " + std::to_string(n));
  const int64_t k_top = p.topk, per_rank = p.local_experts() * p.capacity, slots = n * per_rank;
  if (slots > INT32_MAX || p.tokens > INT32_MAX)
    return Status::Error(std::string(kName) + ": more than 2^31 slots or tokens per rank is not supported");
  for (Plan* plan : {&plans->partials, &plans->sums}) {
    *plan = Plan();
    plan->num_ranks = n;
    plan->in_blocks = per_rank;
    plan->block_bytes = p.row_bytes();
    plan->dtype = p.dtype;
    plan->op = ReduceOp::kSum;
    plan->weighted = true;
  }
  Plan& sums = plans->sums;
  sums.scratch_blocks = per_rank;
  sums.out_blocks = p.tokens;
  // Each owner's partials, in the order their scratch blocks are handed out.
  std::vector<Plan> owners(n);
  for (Plan& o : owners) o.weighted = true;

  struct Pair {
    int32_t owner, row;
    double w;
  };
  std::vector<Pair> kept;
  std::vector<BlockRef> srcs, owner_srcs;
  std::vector<double> ws, owner_ws;
  for (int r = 0; r < n; ++r) {
    bool open_zeros = false;  // the last transfer zeroes a run of r's tokens
    for (int64_t t = 0; t < p.tokens; ++t) {
      kept.clear();
      for (int64_t k = 0; k < k_top; ++k) {
        const int32_t slot = pair_slot[r][t * k_top + k];
        if (slot == -1) continue;
        if (slot < -1 || slot >= slots) {
          std::ostringstream os;
          os << kName << ": rank " << r << "'s pair (token " << t << ", k=" << k << ") has slot " << slot
             << ", outside [-1, " << slots << ")";
          return Status::Error(os.str());
        }
        kept.push_back({static_cast<int32_t>(slot / per_rank), static_cast<int32_t>(slot % per_rank),
                        WeightOf(weights, p.dtype, r, t * k_top + k)});
      }
      const BlockRef y{r, static_cast<int32_t>(t)};
      if (kept.empty()) {
        if (open_zeros) {
          sums.transfers.back().span++;
        } else {
          sums.AddWeighted(nullptr, nullptr, 0, &y, 1);
          open_zeros = true;
        }
        continue;
      }
      open_zeros = false;
      // Owners ascending, k ascending within one (stable: kept is in k order).
      std::stable_sort(kept.begin(), kept.end(), [](const Pair& a, const Pair& b) { return a.owner < b.owner; });
      srcs.clear();
      ws.clear();
      for (size_t begin = 0; begin < kept.size();) {
        size_t end = begin + 1;
        while (end < kept.size() && kept[end].owner == kept[begin].owner) ++end;
        const int32_t o = kept[begin].owner;
        if (end - begin == 1 && !stage_all) {
          srcs.push_back({o, kept[begin].row});  // crosses as it is, weighted on arrival
          ws.push_back(kept[begin].w);
        } else {
          Plan& mine = owners[o];
          const BlockRef partial{o, static_cast<int32_t>(mine.transfers.size())};
          owner_srcs.clear();
          owner_ws.clear();
          const bool lone = end - begin == 1;  // staged as it is (stage_all)
          for (size_t i = begin; i < end; ++i) {
            owner_srcs.push_back({o, kept[i].row});
            owner_ws.push_back(lone ? 1.0 : kept[i].w);
          }
          mine.AddWeighted(owner_srcs.data(), owner_ws.data(), static_cast<uint32_t>(owner_srcs.size()), &partial,
                           1);
          srcs.push_back({o, static_cast<int32_t>(per_rank + partial.block)});
          ws.push_back(lone ? kept[begin].w : 1.0);
        }
        begin = end;
      }
      sums.AddWeighted(srcs.data(), ws.data(), static_cast<uint32_t>(srcs.size()), &y, 1);
    }
  }
  Plan& partials = plans->partials;
  partials.out_blocks = per_rank;
  partials.local_sums = true;
  plans->first_partial.assign(n, 0);
  size_t transfers = 0, refs = 0;
  for (const Plan& o : owners) transfers += o.transfers.size(), refs += o.refs.size();
  partials.transfers.reserve(transfers);
  partials.refs.reserve(refs);
  partials.weights.reserve(refs);
  for (int o = 0; o < n; ++o) {
    plans->first_partial[o] = static_cast<uint32_t>(partials.transfers.size());
    const uint32_t offset = static_cast<uint32_t>(partials.refs.size());
    partials.refs.insert(partials.refs.end(), owners[o].refs.begin(), owners[o].refs.end());
    partials.weights.insert(partials.weights.end(), owners[o].weights.begin(), owners[o].weights.end());
    for (Transfer t : owners[o].transfers) {
      t.src_begin += offset;
      t.dst_begin += offset;
      partials.transfers.push_back(t);
    }
  }
  return Status::Ok();
}

}  // namespace strata
