#include "moe_backward_plan.h"

#include <algorithm>
#include <sstream>
#include <string>

#include "../runtime/collective.h"
#include "moe.h"

namespace strata {

namespace {
constexpr const char* kName = "strata.moe.combine (backward)";

// An empty plan of rows (keeping the storage of the one it replaces).
void Reset(Plan* plan, const MoeOpShape& p, int64_t in_blocks, int64_t out_blocks) {
  plan->Clear();
  plan->num_ranks = p.group_size;
  plan->in_blocks = in_blocks;
  plan->out_blocks = out_blocks;
  plan->block_bytes = p.row_bytes();
  plan->dtype = p.dtype;
}
}  // namespace

Status BuildMoeBackwardPlans(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                             const std::vector<const int32_t*>& slot_source,
                             const std::vector<const void*>& weights, MoeBackwardPlans* plans) {
  const int n = p.group_size;
  const int64_t k_top = p.topk, pairs = p.tokens * p.topk;
  const int64_t per_rank = p.local_experts() * p.capacity, slots = n * per_rank;
  if (slots > INT32_MAX || n * pairs > INT32_MAX)
    return Status::Error(std::string(kName) + ": more than 2^31 slots or pairs in a group is not supported");
  const bool wide = p.dtype == DType::F64;  // float64 weights
  auto weight_of = [&](int r, int64_t pair) -> double {
    if (weights.empty() || !weights[r]) return 1.0;
    return wide ? static_cast<const double*>(weights[r])[pair] : static_cast<const float*>(weights[r])[pair];
  };
  auto fail = [&](const std::string& why) { return Status::Error(std::string(kName) + ": " + why); };

  // Sized once every owner's carried rows are counted (pass 1 below): the
  // scratch holds at most one row per slot.
  Reset(&plans->carry, p, p.tokens, per_rank);
  Reset(&plans->scale, p, 0, per_rank);
  Reset(&plans->dots, p, per_rank, pairs);
  Plan& carry = plans->carry;
  Plan& scale = plans->scale;
  Plan& dots = plans->dots;
  scale.op = ReduceOp::kSum;
  scale.weighted = true;
  scale.local_sums = true;
  dots.op = ReduceOp::kSum;
  dots.dot = true;
  dots.out_block_bytes = static_cast<int64_t>(DTypeSize(MoeWeightDType(p.dtype)));
  plans->first_carry.assign(n, 0);
  std::vector<int32_t>& scratch_of_row = plans->scratch_of_row;
  int64_t scratch_blocks = 0;

  for (int o = 0; o < n; ++o) {
    const int32_t* sources = slot_source[o];
    const int64_t first_slot = static_cast<int64_t>(o) * per_rank;
    // The lowest k of t's pairs on this owner (its lead), from rank r's slots.
    auto lead_row = [&](const int32_t* token_slots) -> int64_t {
      for (int64_t k = 0; k < k_top; ++k)
        if (token_slots[k] >= first_slot && token_slots[k] < first_slot + per_rank) return token_slots[k] - first_slot;
      return -1;
    };
    // Pass 1: a carried row per (token, owner), at the row of its lead.
    plans->first_carry[o] = static_cast<uint32_t>(carry.transfers.size());
    scratch_of_row.assign(per_rank, -1);
    int32_t carried = 0;
    for (int64_t row = 0; row < per_rank; ++row) {
      const int32_t src = sources[row];
      if (src == -1) continue;
      if (src < -1 || src >= n * pairs) {
        std::ostringstream os;
        os << "owner " << o << "'s slot_source[" << row << "] = " << src << " is outside [-1, " << n * pairs << ")";
        return fail(os.str());
      }
      const int r = static_cast<int>(src / pairs);
      const int64_t pair = src % pairs, t = pair / k_top;
      const int32_t* token_slots = pair_slot[r] + t * k_top;
      if (token_slots[pair % k_top] != first_slot + row) {
        std::ostringstream os;
        os << "owner " << o << "'s row " << row << " names rank " << r << "'s pair " << pair
           << " as its source, but that pair's slot is " << token_slots[pair % k_top]
           << ": the handle was modified or mixes two dispatches";
        return fail(os.str());
      }
      if (lead_row(token_slots) != row) continue;
      scratch_of_row[row] = carried++;
      const BlockRef from{r, static_cast<int32_t>(t)}, to{o, scratch_of_row[row]};
      carry.Add(&from, 1, &to, 1);
    }
    scratch_blocks = std::max<int64_t>(scratch_blocks, carried);
    // Pass 2: every row's d_expert_y, every kept pair's d_weights value.
    for (int64_t row = 0; row < per_rank;) {
      const int32_t src = sources[row];
      const BlockRef dst{o, static_cast<int32_t>(row)};
      if (src < 0) {
        int64_t end = row + 1;  // a run of empty rows: one zero fill
        while (end < per_rank && sources[end] < 0) ++end;
        scale.Add(nullptr, 0, &dst, 1, static_cast<uint32_t>(end - row));
        row = end;
        continue;
      }
      const int r = static_cast<int>(src / pairs);
      const int64_t pair = src % pairs;
      const int32_t carried_at = scratch_of_row[lead_row(pair_slot[r] + pair / k_top * k_top)];
      const BlockRef from{o, carried_at};  // scale's scratch starts at block 0 (no input)
      const double w = weight_of(r, pair);
      scale.AddWeighted(&from, &w, 1, &dst, 1);
      const BlockRef operands[2] = {{o, static_cast<int32_t>(per_rank + carried_at)}, dst};
      const BlockRef value{r, static_cast<int32_t>(pair)};
      dots.Add(operands, 2, &value, 1);
      ++row;
    }
  }
  // Dropped pairs' values, zeroed on their token's rank, a run at a time.
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < pairs;) {
      if (pair_slot[r][i] != -1) {
        if (pair_slot[r][i] < -1 || pair_slot[r][i] >= slots) {
          std::ostringstream os;
          os << "rank " << r << "'s pair_slot[" << i << "] = " << pair_slot[r][i] << " is outside [-1, " << slots << ")";
          return fail(os.str());
        }
        ++i;
        continue;
      }
      int64_t end = i + 1;
      while (end < pairs && pair_slot[r][end] == -1) ++end;
      const BlockRef value{r, static_cast<int32_t>(i)};
      dots.Add(nullptr, 0, &value, 1, static_cast<uint32_t>(end - i));
      i = end;
    }
  }
  carry.out_blocks = scratch_blocks;
  scale.scratch_blocks = scratch_blocks;
  dots.scratch_blocks = scratch_blocks;
  return Status::Ok();
}

void PartitionMoeBackwardPlans(const MoeOpShape& p, MoeBackwardPlans* plans, double descriptor_us,
                               double sdma_gbps) {
  Plan& carry = plans->carry;
  carry.on_sdma = PlanMovesOnSdma(carry, 1, p.engines, descriptor_us, sdma_gbps);
  Partition(carry, carry.on_sdma ? p.engines : p.cores, p.planner);
  Partition(plans->scale, p.cores, p.planner);
  Partition(plans->dots, p.cores, p.planner, /*align=*/plans->dots.block_bytes);
}

}  // namespace strata
