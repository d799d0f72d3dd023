#include "moe_combine_plan.h"

#include "moe_plan.h"

#include <algorithm>
#include <sstream>
#include <string>

namespace strata {

namespace {
constexpr const char* kName = "strata.moe.combine";

}  // namespace

MoeCombinePlanBuilder::MoeCombinePlanBuilder(const MoeOpShape& p, bool stage_all, MoeCombinePlans* plans)
    : p_(p),
      stage_all_(stage_all),
      plans_(plans),
      per_rank_(p.local_experts() * p.capacity),
      slots_(p.group_size * per_rank_),
      owner_of_(std::max<int64_t>(per_rank_, 1)),
      sum_transfers_(p.group_size, 0),
      sum_refs_(p.group_size, 0),
      bad_pair_(p.group_size, -1),
      bad_slot_(p.group_size, 0),
      partials_(static_cast<size_t>(p.group_size) * p.group_size, 0),
      partial_refs_(static_cast<size_t>(p.group_size) * p.group_size, 0) {
  plans->grouped.resize(p.group_size);
  plans->grouped_count.resize(p.group_size);
}

bool MoeCombinePlanBuilder::Group(const int32_t* pair_slot, int64_t t, Pair* kept, int64_t* count) const {
  const int64_t divisor = std::max<int64_t>(per_rank_, 1);
  const int64_t k_top = p_.topk;
  *count = 0;
  for (int64_t k = 0; k < k_top; ++k) {
    const int32_t slot = pair_slot[t * k_top + k];
    if (slot == -1) continue;
    if (slot < -1 || slot >= slots_) return false;
    const int32_t owner = owner_of_(slot);
    const Pair pair{owner, static_cast<int32_t>(slot - owner * divisor), static_cast<int32_t>(k)};
    int64_t i = (*count)++;  // insertion sort by owner, stable in k: K is small
    for (; i > 0 && kept[i - 1].owner > pair.owner; --i) kept[i] = kept[i - 1];
    kept[i] = pair;
  }
  return true;
}

namespace {
// The end of the group (pairs of one owner) starting at kept[begin].
template <typename P>
int64_t GroupEnd(const P* kept, int64_t begin, int64_t count) {
  int64_t end = begin + 1;
  while (end < count && kept[end].owner == kept[begin].owner) ++end;
  return end;
}
}  // namespace

void MoeCombinePlanBuilder::Count(int r, const int32_t* pair_slot) {
  if (slots_ > INT32_MAX || p_.tokens > INT32_MAX) return;  // Layout says so
  const int n = p_.group_size;
  std::vector<Pair>& grouped = plans_->grouped[r];
  std::vector<int32_t>& counts = plans_->grouped_count[r];
  grouped.resize(p_.tokens * p_.topk);
  counts.resize(p_.tokens);
  int64_t* const partials = partials_.data() + static_cast<size_t>(r) * n;
  int64_t* const refs = partial_refs_.data() + static_cast<size_t>(r) * n;
  int64_t transfers = 0, sum_refs = 0;
  bool open_zeros = false;
  for (int64_t t = 0; t < p_.tokens; ++t) {
    int64_t count = 0;
    Pair* const kept = grouped.data() + t * p_.topk;
    const bool good = Group(pair_slot, t, kept, &count);
    counts[t] = static_cast<int32_t>(count);
    if (!good) {
      for (int64_t k = 0; k < p_.topk; ++k) {
        const int32_t slot = pair_slot[t * p_.topk + k];
        if (slot < -1 || slot >= slots_) {
          bad_pair_[r] = t * p_.topk + k;
          bad_slot_[r] = slot;
          return;
        }
      }
    }
    if (count == 0) {
      if (!open_zeros) transfers++, sum_refs++;
      open_zeros = true;
      continue;
    }
    open_zeros = false;
    transfers++;
    sum_refs++;  // y
    for (int64_t begin = 0; begin < count;) {
      const int64_t end = GroupEnd(kept, begin, count);
      sum_refs++;
      if (end - begin > 1 || stage_all_) {
        partials[kept[begin].owner]++;
        refs[kept[begin].owner] += end - begin + 1;
      }
      begin = end;
    }
  }
  sum_transfers_[r] = transfers;
  sum_refs_[r] = sum_refs;
}

Status MoeCombinePlanBuilder::Layout() {
  MoeCombinePlans* const plans = plans_;
  const int n = p_.group_size;
  if (slots_ > INT32_MAX || p_.tokens > INT32_MAX)
    return Status::Error(std::string(kName) + ": more than 2^31 slots or tokens per rank is not supported");
  for (int r = 0; r < n; ++r) {
    if (bad_pair_[r] < 0) continue;
    // Count(r) saw it; the first bad pair, as one walk finds it.
    const int64_t t = bad_pair_[r] / p_.topk, k = bad_pair_[r] % p_.topk;
    std::ostringstream os;
    os << kName << ": rank " << r << "'s pair (token " << t << ", k=" << k << ") has slot " << bad_slot_[r]
       << ", outside [-1, " << slots_ << ")";
    return Status::Error(os.str());
  }
  for (Plan* plan : {&plans->partials, &plans->sums}) {
    plan->Clear();  // keeping the storage of a pooled plan (runtime: AcquireCombinePlans)
    plan->num_ranks = n;
    plan->in_blocks = per_rank_;
    plan->block_bytes = p_.row_bytes();
    plan->dtype = p_.dtype;
    plan->op = ReduceOp::kSum;
    plan->weighted = true;
  }
  Plan& sums = plans->sums;
  Plan& partials = plans->partials;
  sums.scratch_blocks = per_rank_;
  sums.out_blocks = p_.tokens;
  partials.out_blocks = per_rank_;
  partials.local_sums = true;
  // Owner by owner (producer_first: the owner's j-th scratch block is its
  // j-th partial), ranks ascending within an owner; sums rank by rank.
  plans->first_partial.assign(n, 0);
  int64_t transfers = 0, refs = 0;
  for (int o = 0; o < n; ++o) {
    plans->first_partial[o] = static_cast<uint32_t>(transfers);
    for (int r = 0; r < n; ++r) {
      const size_t at = static_cast<size_t>(r) * n + o;
      const int64_t count = partials_[at], ref_count = partial_refs_[at];
      partials_[at] = transfers;  // now: where r's partials on o start
      partial_refs_[at] = refs;
      transfers += count;
      refs += ref_count;
    }
  }
  if (transfers > UINT32_MAX || refs > UINT32_MAX)
    return Status::Error(std::string(kName) + ": more than 2^32 transfers per plan is not supported");
  partials.transfers.resize(transfers);
  partials.refs.resize(refs);
  partials.weights.resize(refs);
  sum_start_.assign(n, 0);
  sum_ref_start_.assign(n, 0);
  int64_t sum_transfers = 0, sum_refs = 0;
  for (int r = 0; r < n; ++r) {
    sum_start_[r] = sum_transfers;
    sum_ref_start_[r] = sum_refs;
    sum_transfers += sum_transfers_[r];
    sum_refs += sum_refs_[r];
  }
  if (sum_refs > UINT32_MAX)
    return Status::Error(std::string(kName) + ": more than 2^32 refs per plan is not supported");
  sums.transfers.resize(sum_transfers);
  sums.refs.resize(sum_refs);
  sums.weights.resize(sum_refs);
  return Status::Ok();
}

void MoeCombinePlanBuilder::Fill(int r, const void* weights) const {
  MoeCombinePlans* const plans = plans_;
  const int n = p_.group_size;
  const int64_t k_top = p_.topk;
  Plan& sums = plans->sums;
  Plan& partials = plans->partials;
  const Pair* const grouped = plans->grouped[r].data();
  const int32_t* const counts = plans->grouped_count[r].data();
  // Where r's next partial on each owner and its refs go.
  thread_local std::vector<int64_t> thread_next, thread_next_ref;
  thread_next.assign(partials_.begin() + static_cast<size_t>(r) * n, partials_.begin() + static_cast<size_t>(r + 1) * n);
  thread_next_ref.assign(partial_refs_.begin() + static_cast<size_t>(r) * n,
                         partial_refs_.begin() + static_cast<size_t>(r + 1) * n);
  int64_t* const next = thread_next.data();
  int64_t* const next_ref = thread_next_ref.data();
  const float* w32 = weights && p_.dtype != DType::F64 ? static_cast<const float*>(weights) : nullptr;
  const double* w64 = weights && p_.dtype == DType::F64 ? static_cast<const double*>(weights) : nullptr;
  auto weight = [&](int64_t t, int64_t k) {
    return w32 ? static_cast<double>(w32[t * k_top + k]) : w64 ? w64[t * k_top + k] : 1.0;
  };
  int64_t transfer = sum_start_[r], ref = sum_ref_start_[r];
  bool open_zeros = false;  // the last transfer zeroes a run of r's tokens
  for (int64_t t = 0; t < p_.tokens; ++t) {
    const int64_t count = counts[t];
    const Pair* const kept = grouped + t * k_top;
    const BlockRef y{r, static_cast<int32_t>(t)};
    if (count == 0) {
      if (open_zeros) {
        sums.transfers[transfer - 1].span++;
        continue;
      }
      Transfer& zero = sums.transfers[transfer++];
      zero = Transfer();
      zero.src_begin = zero.dst_begin = static_cast<uint32_t>(ref);
      zero.dst_count = 1;
      sums.refs[ref] = y;
      sums.weights[ref++] = 1.0;
      open_zeros = true;
      continue;
    }
    open_zeros = false;
    Transfer& sum = sums.transfers[transfer++];
    sum = Transfer();
    sum.src_begin = static_cast<uint32_t>(ref);
    for (int64_t begin = 0; begin < count;) {
      const int64_t end = GroupEnd(kept, begin, count);
      const int32_t o = kept[begin].owner;
      if (end - begin == 1 && !stage_all_) {
        sums.refs[ref] = {o, kept[begin].row};  // crosses as it is, weighted on arrival
        sums.weights[ref++] = weight(t, kept[begin].k);
      } else {
        const bool lone = end - begin == 1;  // staged as it is (stage_all), weighted where read
        const int64_t index = next[o]++;
        Transfer& partial = partials.transfers[index];
        partial = Transfer();
        partial.src_begin = static_cast<uint32_t>(next_ref[o]);
        partial.src_count = static_cast<uint32_t>(end - begin);
        for (int64_t i = begin; i < end; ++i) {
          partials.refs[next_ref[o]] = {o, kept[i].row};
          partials.weights[next_ref[o]++] = lone ? 1.0 : weight(t, kept[i].k);
        }
        const int32_t block = static_cast<int32_t>(index - plans->first_partial[o]);
        partial.dst_begin = static_cast<uint32_t>(next_ref[o]);
        partial.dst_count = 1;
        partials.refs[next_ref[o]] = {o, block};
        partials.weights[next_ref[o]++] = 1.0;
        sums.refs[ref] = {o, static_cast<int32_t>(per_rank_ + block)};
        sums.weights[ref++] = lone ? weight(t, kept[begin].k) : 1.0;
      }
      begin = end;
    }
    sum.src_count = static_cast<uint32_t>(ref - sum.src_begin);
    sum.dst_begin = static_cast<uint32_t>(ref);
    sum.dst_count = 1;
    sums.refs[ref] = y;
    sums.weights[ref++] = 1.0;
  }
}

Status BuildMoeCombinePlans(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                            const std::vector<const void*>& weights, bool stage_all, MoeCombinePlans* plans) {
  const int n = p.group_size;
  if (static_cast<int>(pair_slot.size()) != n || (!weights.empty() && static_cast<int>(weights.size()) != n))
    return Status::Error(std::string(kName) + ": " + std::to_string(pair_slot.size()) +
                         " ranks' slots for a group of " + std::to_string(n));
  MoeCombinePlanBuilder builder(p, stage_all, plans);
  for (int r = 0; r < n; ++r) builder.Count(r, pair_slot[r]);
  const Status st = builder.Layout();
  if (!st.ok) return st;
  for (int r = 0; r < n; ++r) builder.Fill(r, weights.empty() ? nullptr : weights[r]);
  return Status::Ok();
}

}  // namespace strata
