#include "moe_backward_plan.h"

#include <algorithm>
#include <cstring>
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

// The three plans' kinds and layouts (a share's, or the whole op's).
void ResetAll(const MoeOpShape& p, Plan* carry, Plan* scale, Plan* dots) {
  const int64_t per_rank = p.local_experts() * p.capacity;
  Reset(carry, p, p.tokens, per_rank);  // out_blocks: the scratch, sized by Layout
  Reset(scale, p, 0, per_rank);
  Reset(dots, p, per_rank, p.tokens * p.topk);
  scale->op = ReduceOp::kSum;
  scale->weighted = true;
  scale->local_sums = true;
  dots->op = ReduceOp::kSum;
  dots->dot = true;
  dots->out_block_bytes = static_cast<int64_t>(DTypeSize(MoeWeightDType(p.dtype)));
}
}  // namespace

MoeBackwardPlanBuilder::MoeBackwardPlanBuilder(const MoeOpShape& p, std::vector<const int32_t*> pair_slot,
                                               std::vector<const int32_t*> slot_source,
                                               std::vector<const void*> weights, MoeBackwardPlans* plans)
    : p_(p), pair_slot_(std::move(pair_slot)), slot_source_(std::move(slot_source)),
      weights_(std::move(weights)), plans_(plans) {
  plans->shares.resize(p.group_size);
  for (auto& at : transfer_at_) at.assign(p.group_size + 1, 0);
  for (auto& at : ref_at_) at.assign(p.group_size + 1, 0);
}

void MoeBackwardPlanBuilder::Owner(int o) {
  const MoeOpShape& p = p_;
  const int n = p.group_size;
  const int64_t k_top = p.topk, pairs = p.tokens * p.topk;
  const int64_t per_rank = p.local_experts() * p.capacity, slots = n * per_rank;
  MoeBackwardPlans::Share& share = plans_->shares[o];
  share.error.clear();
  ResetAll(p, &share.carry, &share.scale, &share.dots);
  if (slots > INT32_MAX || n * pairs > INT32_MAX) {
    share.error = std::string(kName) + ": more than 2^31 slots or pairs in a group is not supported";
    return;
  }
  const bool wide = p.dtype == DType::F64;  // float64 weights
  auto weight_of = [&](int r, int64_t pair) -> double {
    if (weights_.empty() || !weights_[r]) return 1.0;
    return wide ? static_cast<const double*>(weights_[r])[pair] : static_cast<const float*>(weights_[r])[pair];
  };
  auto fail = [&](const std::string& why) { share.error = std::string(kName) + ": " + why; };
  const int32_t* sources = slot_source_[o];
  const int64_t first_slot = static_cast<int64_t>(o) * per_rank;
  // The row of the lowest k of a token's pairs on this owner (its lead).
  auto lead_row = [&](const int32_t* token_slots) -> int64_t {
    for (int64_t k = 0; k < k_top; ++k)
      if (token_slots[k] >= first_slot && token_slots[k] < first_slot + per_rank) return token_slots[k] - first_slot;
    return -1;
  };

  // Pass 1: a carried row per (token, owner), in the order of its lead's row.
  for (int64_t row = 0; row < per_rank; ++row) {
    const int32_t src = sources[row];
    if (src == -1) continue;
    if (src < -1 || src >= n * pairs) {
      std::ostringstream os;
      os << "owner " << o << "'s slot_source[" << row << "] = " << src << " is outside [-1, " << n * pairs << ")";
      return fail(os.str());
    }
    // 32-bit divides (src < 2^31): a 64-bit one per row was a third of the build.
    const uint32_t u_src = static_cast<uint32_t>(src), u_pairs = static_cast<uint32_t>(pairs);
    const int r = static_cast<int>(u_src / u_pairs);
    const int64_t pair = u_src - static_cast<uint32_t>(r) * u_pairs;
    const int64_t t = static_cast<uint32_t>(pair) / static_cast<uint32_t>(k_top);
    const int32_t* token_slots = pair_slot_[r] + t * k_top;
    if (token_slots[pair - t * k_top] != first_slot + row) {
      std::ostringstream os;
      os << "owner " << o << "'s row " << row << " names rank " << r << "'s pair " << pair
         << " as its source, but that pair's slot is " << token_slots[pair - t * k_top]
         << ": the handle was modified or mixes two dispatches";
      return fail(os.str());
    }
    if (lead_row(token_slots) != row) continue;
    const BlockRef from{r, static_cast<int32_t>(t)}, to{o, static_cast<int32_t>(share.carry.transfers.size())};
    share.carry.Add(&from, 1, &to, 1);
  }
  // Pass 2, token by token (a carried row at a time, so its readers follow
  // one another and it is read from cache: in row order each token's row
  // came back from memory once per pair, scale and dots alike): w x the
  // carried row into each of the token's rows here, k ascending, and each
  // pair's dot. Then the runs of empty rows, zeroed.
  for (uint32_t j = 0; j < share.carry.transfers.size(); ++j) {
    const BlockRef& token = share.carry.refs[share.carry.transfers[j].src_begin];
    const int r = token.rank;
    const int32_t* token_slots = pair_slot_[r] + static_cast<int64_t>(token.block) * k_top;
    for (int64_t k = 0; k < k_top; ++k) {
      const int64_t row = token_slots[k] - first_slot;
      if (row < 0 || row >= per_rank) continue;
      const int64_t pair = static_cast<int64_t>(token.block) * k_top + k;
      if (sources[row] != r * pairs + pair) {
        std::ostringstream os;
        os << "rank " << r << "'s pair " << pair << " has slot " << token_slots[k] << " but that slot's source is "
           << sources[row] << ": the handle was modified or mixes two dispatches";
        return fail(os.str());
      }
      const BlockRef dst{o, static_cast<int32_t>(row)};
      const BlockRef from{o, static_cast<int32_t>(j)};  // scale's scratch starts at block 0 (no input)
      const double w = weight_of(r, pair);
      share.scale.AddWeighted(&from, &w, 1, &dst, 1);
      const BlockRef operands[2] = {{o, static_cast<int32_t>(per_rank + j)}, dst};
      const BlockRef value{r, static_cast<int32_t>(pair)};
      share.dots.Add(operands, 2, &value, 1);
    }
  }
  for (int64_t row = 0; row < per_rank;) {
    if (sources[row] >= 0) {
      ++row;
      continue;
    }
    int64_t end = row + 1;
    while (end < per_rank && sources[end] < 0) ++end;
    const BlockRef dst{o, static_cast<int32_t>(row)};
    share.scale.Add(nullptr, 0, &dst, 1, static_cast<uint32_t>(end - row));
    row = end;
  }
  // Rank o's dropped pairs' values, zeroed on it, a run at a time.
  const int32_t* mine = pair_slot_[o];
  for (int64_t i = 0; i < pairs;) {
    if (mine[i] != -1) {
      if (mine[i] < -1 || mine[i] >= slots) {
        std::ostringstream os;
        os << "rank " << o << "'s pair_slot[" << i << "] = " << mine[i] << " is outside [-1, " << slots << ")";
        return fail(os.str());
      }
      ++i;
      continue;
    }
    int64_t end = i + 1;
    while (end < pairs && mine[end] == -1) ++end;
    const BlockRef value{o, static_cast<int32_t>(i)};
    share.dots.Add(nullptr, 0, &value, 1, static_cast<uint32_t>(end - i));
    i = end;
  }
}

Status MoeBackwardPlanBuilder::Layout() {
  const int n = p_.group_size;
  MoeBackwardPlans& plans = *plans_;
  for (int o = 0; o < n; ++o)
    if (!plans.shares[o].error.empty()) return Status::Error(plans.shares[o].error);
  ResetAll(p_, &plans.carry, &plans.scale, &plans.dots);
  Plan* whole[3] = {&plans.carry, &plans.scale, &plans.dots};
  int64_t scratch_blocks = 0;
  for (int o = 0; o < n; ++o) {
    const MoeBackwardPlans::Share& share = plans.shares[o];
    const Plan* part[3] = {&share.carry, &share.scale, &share.dots};
    for (int i = 0; i < 3; ++i) {
      transfer_at_[i][o + 1] = transfer_at_[i][o] + static_cast<uint32_t>(part[i]->transfers.size());
      ref_at_[i][o + 1] = ref_at_[i][o] + static_cast<uint32_t>(part[i]->refs.size());
    }
    scratch_blocks = std::max<int64_t>(scratch_blocks, static_cast<int64_t>(share.carry.transfers.size()));
  }
  for (int i = 0; i < 3; ++i) {
    whole[i]->transfers.resize(transfer_at_[i][n]);
    whole[i]->refs.resize(ref_at_[i][n]);
  }
  plans.scale.weights.resize(ref_at_[1][n]);
  plans.carry.out_blocks = scratch_blocks;
  plans.scale.scratch_blocks = scratch_blocks;
  plans.dots.scratch_blocks = scratch_blocks;
  plans.first_carry.assign(transfer_at_[0].begin(), transfer_at_[0].end() - 1);
  return Status::Ok();
}

void MoeBackwardPlanBuilder::Join(int o) {
  MoeBackwardPlans& plans = *plans_;
  const MoeBackwardPlans::Share& share = plans.shares[o];
  Plan* whole[3] = {&plans.carry, &plans.scale, &plans.dots};
  const Plan* part[3] = {&share.carry, &share.scale, &share.dots};
  for (int i = 0; i < 3; ++i) {
    const uint32_t refs = ref_at_[i][o];
    Transfer* to = whole[i]->transfers.data() + transfer_at_[i][o];
    for (const Transfer& t : part[i]->transfers) {
      Transfer moved = t;
      moved.src_begin += refs;
      moved.dst_begin += refs;
      *to++ = moved;
    }
    if (!part[i]->refs.empty())
      std::memcpy(whole[i]->refs.data() + refs, part[i]->refs.data(), part[i]->refs.size() * sizeof(BlockRef));
  }
  if (!share.scale.weights.empty())
    std::memcpy(plans.scale.weights.data() + ref_at_[1][o], share.scale.weights.data(),
                share.scale.weights.size() * sizeof(double));
}

Status BuildMoeBackwardPlans(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                             const std::vector<const int32_t*>& slot_source,
                             const std::vector<const void*>& weights, MoeBackwardPlans* plans) {
  MoeBackwardPlanBuilder builder(p, pair_slot, slot_source, weights, plans);
  for (int o = 0; o < p.group_size; ++o) builder.Owner(o);
  const Status st = builder.Layout();
  if (!st.ok) return st;
  for (int o = 0; o < p.group_size; ++o) builder.Join(o);
  return Status::Ok();
}

Status MoeSlotSources(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                      std::vector<std::vector<int32_t>>* slot_source) {
  const int n = p.group_size;
  const int64_t pairs = p.tokens * p.topk, per_rank = p.local_experts() * p.capacity;
  slot_source->assign(n, std::vector<int32_t>(per_rank, -1));
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < pairs; ++i) {
      const int32_t slot = pair_slot[r][i];
      if (slot == -1) continue;
      if (slot < -1 || slot >= n * per_rank) {
        std::ostringstream os;
        os << kName << ": rank " << r << "'s pair_slot[" << i << "] = " << slot << " is outside [-1, " << n * per_rank << ")";
        return Status::Error(os.str());
      }
      (*slot_source)[slot / per_rank][slot % per_rank] = static_cast<int32_t>(r * pairs + i);
    }
  return Status::Ok();
}

void PartitionMoeBackwardPlan(const MoeOpShape& p, MoeBackwardPlans* plans, int which, double descriptor_us,
                              double sdma_gbps) {
  if (which == 0) {
    Plan& carry = plans->carry;
    carry.on_sdma = PlanMovesOnSdma(carry, 1, p.engines, descriptor_us, sdma_gbps);
    Partition(carry, carry.on_sdma ? p.engines : p.cores, p.planner);
  } else if (which == 1) {
    Partition(plans->scale, p.cores, p.planner);
  } else {
    Partition(plans->dots, p.cores, p.planner, /*align=*/plans->dots.block_bytes);
  }
}

void PartitionMoeBackwardPlans(const MoeOpShape& p, MoeBackwardPlans* plans, double descriptor_us,
                               double sdma_gbps) {
  for (int which = 0; which < 3; ++which) PartitionMoeBackwardPlan(p, plans, which, descriptor_us, sdma_gbps);
}

}  // namespace strata
