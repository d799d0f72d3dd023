#include "moe_combine_plan.h"

#include "moe_plan.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>

namespace strata {

namespace {
constexpr const char* kName = "strata.moe.combine";

// A kept pair as the builder groups a token's pairs: owner << 32 | k, so
// ascending keys are owners ascending, k ascending within one (its row is
// its slot's, read again where it is needed: a 12-byte record per pair,
// moved by the sort, was a third of the build).
inline int32_t OwnerOfKey(uint64_t key) { return static_cast<int32_t>(key >> 32); }
inline int64_t KOfKey(uint64_t key) { return static_cast<int64_t>(static_cast<uint32_t>(key)); }
// Top-k up to this many is sorted by ranks, on the stack; above, by insertion.
constexpr int64_t kSortedTopK = 64;

// Token t's kept pairs by owner (ascending; k ascending within one) into
// `kept`, their number into *count; false on a bad slot.
bool Group(const int32_t* pair_slot, int64_t t, int64_t k_top, int64_t slots, const OwnerOf& owner_of,
           uint64_t* kept, int64_t* count) {
  // The keys first, then each one's place: the number of keys below it
  // (keys are distinct). No branch depends on the routing: an insertion
  // sort's were mispredicted at most pairs, a third of the build.
  if (k_top > kSortedTopK) {
    int64_t n = 0;
    for (int64_t k = 0; k < k_top; ++k) {
      const int32_t slot = pair_slot[t * k_top + k];
      if (slot == -1) continue;
      if (slot < -1 || slot >= slots) return false;
      const uint64_t key = static_cast<uint64_t>(owner_of(slot)) << 32 | static_cast<uint64_t>(k);
      int64_t i = n++;  // insertion sort, k arriving ascending
      for (; i > 0 && kept[i - 1] > key; --i) kept[i] = kept[i - 1];
      kept[i] = key;
    }
    *count = n;
    return true;
  }
  uint64_t keys[kSortedTopK];
  int64_t n = 0;
  for (int64_t k = 0; k < k_top; ++k) {
    const int32_t slot = pair_slot[t * k_top + k];
    if (slot == -1) continue;
    if (slot < -1 || slot >= slots) return false;
    keys[n++] = static_cast<uint64_t>(owner_of(slot)) << 32 | static_cast<uint64_t>(k);
  }
  if (k_top <= 8) {
    // Eight keys (the missing ones past every real key) through a sorting
    // network, in registers: 19 branch-free compare-exchanges where the
    // counting below loops over 64 compares (a fifth of the build's samples
    // at top-8; the share 26 -> 24 us at the A/B's shape, one thread). On
    // the stack, through std::min/max, it was slower than the counting.
    for (int64_t i = n; i < 8; ++i) keys[i] = UINT64_MAX;
    uint64_t k0 = keys[0], k1 = keys[1], k2 = keys[2], k3 = keys[3], k4 = keys[4], k5 = keys[5], k6 = keys[6],
             k7 = keys[7];
    auto order = [](uint64_t& a, uint64_t& b) {
      const uint64_t lo = a < b ? a : b;
      b ^= a ^ lo;  // the other one
      a = lo;
    };
    order(k0, k2), order(k1, k3), order(k4, k6), order(k5, k7);
    order(k0, k4), order(k1, k5), order(k2, k6), order(k3, k7);
    order(k0, k1), order(k2, k3), order(k4, k5), order(k6, k7);
    order(k2, k4), order(k3, k5);
    order(k1, k4), order(k3, k6);
    order(k1, k2), order(k3, k4), order(k5, k6);
    keys[0] = k0, keys[1] = k1, keys[2] = k2, keys[3] = k3, keys[4] = k4, keys[5] = k5, keys[6] = k6, keys[7] = k7;
    std::copy_n(keys, n, kept);
    *count = n;
    return true;
  }
  for (int64_t i = 0; i < n; ++i) {
    int64_t below = 0;
    for (int64_t j = 0; j < n; ++j) below += keys[j] < keys[i];
    kept[below] = keys[i];
  }
  *count = n;
  return true;
}

// The end of the group (pairs of one owner) starting at kept[begin].
int64_t GroupEnd(const uint64_t* kept, int64_t begin, int64_t count) {
  const int32_t owner = OwnerOfKey(kept[begin]);
  int64_t end = begin + 1;
  while (end < count && OwnerOfKey(kept[end]) == owner) ++end;
  return end;
}

// A combine plan's fields, with `transfers` transfers and `refs` refs and
// weights to fill in (the lists keep their storage: shares and plans are
// pooled by the runtime).
void Reset(const MoeOpShape& p, bool partials, int64_t transfers, int64_t refs, Plan* plan) {
  const int64_t per_rank = p.local_experts() * p.capacity;
  plan->ClearKeepingElements();
  plan->transfers.resize(transfers);
  plan->refs.resize(refs);
  plan->weights.resize(refs);
  plan->num_ranks = p.group_size;
  plan->in_blocks = per_rank;
  plan->block_bytes = p.row_bytes();
  plan->dtype = p.dtype;
  plan->op = ReduceOp::kSum;
  plan->weighted = true;
  if (partials) {
    plan->out_blocks = per_rank;
    plan->local_sums = true;
  } else {
    plan->scratch_blocks = per_rank;
    plan->out_blocks = p.tokens;
  }
}

Status TooMany(const char* what) {
  return Status::Error(std::string(kName) + ": more than 2^32 " + what + " per plan is not supported");
}
}  // namespace

int64_t MoeCombineShare::CapacityBytes() const {
  int64_t bytes = 0;
  for (const Plan* plan : {&sums, &partials})
    bytes += plan->refs.capacity() * sizeof(BlockRef) + plan->transfers.capacity() * sizeof(Transfer) +
             plan->weights.capacity() * sizeof(double) + plan->pieces.capacity() * sizeof(Piece) +
             plan->tasks.capacity() * sizeof(LaneTask);
  return bytes + grouped.capacity() * sizeof(uint64_t) + grouped_count.capacity() * sizeof(int32_t) +
         sums_credit.tasks.capacity() * sizeof(LaneTask);
}

Status BuildMoeCombineShare(const MoeOpShape& p, bool stage_all, int r, const int32_t* pair_slot,
                            const void* weights, MoeCombineShare* share) {
  const int n = p.group_size;
  const int64_t per_rank = p.local_experts() * p.capacity, slots = n * per_rank, k_top = p.topk;
  if (slots > INT32_MAX || p.tokens > INT32_MAX)
    return Status::Error(std::string(kName) + ": more than 2^31 slots or tokens per rank is not supported");
  const OwnerOf owner_of(std::max<int64_t>(per_rank, 1));  // a 64-bit divide per pair was most of the build

  // Pass 1: group each token's pairs by owner; count r's sums and its
  // partials on each owner (first_partial[o + 1], first_partial_ref[o + 1]).
  std::vector<uint64_t>& grouped = share->grouped;
  std::vector<int32_t>& counts = share->grouped_count;
  grouped.resize(p.tokens * k_top);
  counts.resize(p.tokens);
  std::vector<uint32_t>& first = share->first_partial;
  std::vector<uint32_t>& first_ref = share->first_partial_ref;
  first.assign(n + 1, 0);
  first_ref.assign(n + 1, 0);
  int64_t sum_transfers = 0, sum_refs = 0, partials = 0, partial_refs = 0;
  bool open_zeros = false;  // the last sum zeroes a run of r's tokens
  for (int64_t t = 0; t < p.tokens; ++t) {
    int64_t count = 0;
    uint64_t* const kept = grouped.data() + t * k_top;
    if (!Group(pair_slot, t, k_top, slots, owner_of, kept, &count)) {
      for (int64_t k = 0; k < k_top; ++k) {
        const int32_t slot = pair_slot[t * k_top + k];
        if (slot >= -1 && slot < slots) continue;
        std::ostringstream os;
        os << kName << ": rank " << r << "'s pair (token " << t << ", k=" << k << ") has slot " << slot
           << ", outside [-1, " << slots << ")";
        return Status::Error(os.str());
      }
    }
    counts[t] = static_cast<int32_t>(count);
    if (count == 0) {
      if (!open_zeros) sum_transfers++, sum_refs++;
      open_zeros = true;
      continue;
    }
    open_zeros = false;
    sum_transfers++;
    sum_refs++;  // y
    for (int64_t begin = 0; begin < count;) {
      const int64_t end = GroupEnd(kept, begin, count);
      sum_refs++;
      if (end - begin > 1 || stage_all) {
        const int32_t o = OwnerOfKey(kept[begin]);
        first[o + 1]++;
        first_ref[o + 1] += static_cast<uint32_t>(end - begin + 1);
        partials++;
        partial_refs += end - begin + 1;
      }
      begin = end;
    }
  }
  if (sum_refs > UINT32_MAX || partial_refs > UINT32_MAX) return TooMany("refs");
  for (int o = 0; o < n; ++o) {
    first[o + 1] += first[o];
    first_ref[o + 1] += first_ref[o];
  }

  // Pass 2: fill both plans in.
  Plan& sums = share->sums;
  Plan& parts = share->partials;
  Reset(p, false, sum_transfers, sum_refs, &sums);
  Reset(p, true, partials, partial_refs, &parts);
  // Where r's next partial on each owner and its refs go.
  thread_local std::vector<uint32_t> thread_next, thread_next_ref;
  thread_next.assign(first.begin(), first.end() - 1);
  thread_next_ref.assign(first_ref.begin(), first_ref.end() - 1);
  uint32_t* const next = thread_next.data();
  uint32_t* const next_ref = thread_next_ref.data();
  const float* w32 = weights && p.dtype != DType::F64 ? static_cast<const float*>(weights) : nullptr;
  const double* w64 = weights && p.dtype == DType::F64 ? static_cast<const double*>(weights) : nullptr;
  auto weight = [&](int64_t t, int64_t k) {
    return w32 ? static_cast<double>(w32[t * k_top + k]) : w64 ? w64[t * k_top + k] : 1.0;
  };
  uint32_t transfer = 0, ref = 0;
  open_zeros = false;
  for (int64_t t = 0; t < p.tokens; ++t) {
    const int64_t count = counts[t];
    const uint64_t* const kept = grouped.data() + t * k_top;
    // Pair (t, k)'s row on its owner o.
    auto row_of = [&](int64_t k, int32_t o) { return static_cast<int32_t>(pair_slot[t * k_top + k] - o * per_rank); };
    const BlockRef y{r, static_cast<int32_t>(t)};
    if (count == 0) {
      if (open_zeros) {
        sums.transfers[transfer - 1].span++;
        continue;
      }
      Transfer& zero = sums.transfers[transfer++];
      zero = Transfer();
      zero.src_begin = zero.dst_begin = ref;
      zero.dst_count = 1;
      sums.refs[ref] = y;
      sums.weights[ref++] = 1.0;
      open_zeros = true;
      continue;
    }
    open_zeros = false;
    Transfer& sum = sums.transfers[transfer++];
    sum = Transfer();
    sum.src_begin = ref;
    for (int64_t begin = 0; begin < count;) {
      const int64_t end = GroupEnd(kept, begin, count);
      const int32_t o = OwnerOfKey(kept[begin]);
      if (end - begin == 1 && !stage_all) {
        const int64_t k = KOfKey(kept[begin]);
        sums.refs[ref] = {o, row_of(k, o)};  // crosses as it is, weighted on arrival
        sums.weights[ref++] = weight(t, k);
      } else {
        const bool lone = end - begin == 1;  // staged as it is (stage_all), weighted where read
        const uint32_t index = next[o]++;
        Transfer& partial = parts.transfers[index];
        partial = Transfer();
        partial.src_begin = next_ref[o];
        partial.src_count = static_cast<uint32_t>(end - begin);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t k = KOfKey(kept[i]);
          parts.refs[next_ref[o]] = {o, row_of(k, o)};
          parts.weights[next_ref[o]++] = lone ? 1.0 : weight(t, k);
        }
        const int32_t block = static_cast<int32_t>(index - first[o]);
        partial.dst_begin = next_ref[o];
        partial.dst_count = 1;
        parts.refs[next_ref[o]] = {o, block};
        parts.weights[next_ref[o]++] = 1.0;
        sums.refs[ref] = {o, static_cast<int32_t>(per_rank + block)};
        sums.weights[ref++] = lone ? weight(t, KOfKey(kept[begin])) : 1.0;
      }
      begin = end;
    }
    sum.src_count = ref - sum.src_begin;
    sum.dst_begin = ref;
    sum.dst_count = 1;
    sums.refs[ref] = y;
    sums.weights[ref++] = 1.0;
  }
  return Status::Ok();
}

Phase MoeCombineSharesPhase(const MoeOpShape& p, std::vector<std::shared_ptr<const MoeCombineShare>> shares,
                            const PlanBuffers& buffers, int64_t transfers_per_task) {
  std::vector<PlanGroup> groups(1);
  groups[0].buffers = buffers;
  // Tasks of about a host chunk of rows read and written (a token reads at
  // most topk rows and writes one): a few per share, so a group's shares
  // spread over the workers.
  const int64_t per_task =
      transfers_per_task > 0
          ? transfers_per_task
          : std::max<int64_t>(1, kHostChunkBytes / std::max<int64_t>(1, p.row_bytes() * (p.topk + 1)));
  std::vector<uint64_t> first_task(1, 0);  // share r's tasks: [first_task[r], first_task[r + 1])
  for (const std::shared_ptr<const MoeCombineShare>& share : shares) {
    groups[0].plans.push_back({std::shared_ptr<const Plan>(share, &share->sums),
                               std::shared_ptr<const Plan>(share, &share->partials),
                               std::shared_ptr<const std::vector<uint32_t>>(share, &share->first_partial)});
    const int64_t transfers = static_cast<int64_t>(share->sums.transfers.size());
    first_task.push_back(first_task.back() + static_cast<uint64_t>((transfers + per_task - 1) / per_task));
  }
  const uint64_t tasks = first_task.back();
  auto order = [first_task = std::move(first_task), per_task](uint64_t task, const TransferRunner& run) {
    const size_t r = static_cast<size_t>(std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin()) - 1;
    const uint32_t begin = static_cast<uint32_t>((task - first_task[r]) * per_task);
    run.RunRange(0, r, begin, begin + static_cast<uint32_t>(per_task));
  };
  return OrderedPlanPhase(std::move(groups), tasks, std::move(order));
}

Status JoinMoeCombineShares(const MoeOpShape& p, const std::vector<const MoeCombineShare*>& shares,
                            MoeCombinePlans* plans, bool join_partials, bool join_sums) {
  const int n = p.group_size;
  if (static_cast<int>(shares.size()) != n)
    return Status::Error(std::string(kName) + ": " + std::to_string(shares.size()) + " ranks' shares for a group of " +
                         std::to_string(n));
  const int64_t in_blocks = p.local_experts() * p.capacity;
  int64_t partials = 0, partial_refs = 0, sum_transfers = 0, sum_refs = 0;
  for (const MoeCombineShare* s : shares) {
    partials += s->partials.transfers.size();
    partial_refs += s->partials.refs.size();
    sum_transfers += s->sums.transfers.size();
    sum_refs += s->sums.refs.size();
  }
  if (partials > UINT32_MAX || sum_transfers > UINT32_MAX) return TooMany("transfers");
  if (partial_refs > UINT32_MAX || sum_refs > UINT32_MAX) return TooMany("refs");

  if (join_partials) {
    // Owner by owner (the owner's j-th scratch block is its j-th partial),
    // ranks ascending within an owner.
    Plan& out = plans->partials;
    Reset(p, true, partials, partial_refs, &out);
    plans->first_partial.assign(n, 0);
    uint32_t transfer = 0, ref = 0;
    for (int o = 0; o < n; ++o) {
      plans->first_partial[o] = transfer;
      for (int r = 0; r < n; ++r) {
        const MoeCombineShare& s = *shares[r];
        const uint32_t t0 = s.first_partial[o], t1 = s.first_partial[o + 1];
        const uint32_t r0 = s.first_partial_ref[o], r1 = s.first_partial_ref[o + 1];
        if (t0 == t1) continue;
        const uint32_t shift = ref - r0;               // the refs move by this
        const int32_t base = static_cast<int32_t>(transfer - plans->first_partial[o]);  // o's partials of lower ranks
        std::copy(s.partials.refs.begin() + r0, s.partials.refs.begin() + r1, out.refs.begin() + ref);
        std::copy(s.partials.weights.begin() + r0, s.partials.weights.begin() + r1, out.weights.begin() + ref);
        for (uint32_t i = t0; i < t1; ++i) {
          Transfer t = s.partials.transfers[i];
          t.src_begin += shift;
          t.dst_begin += shift;
          out.refs[t.dst_begin].block += base;
          out.transfers[transfer++] = t;
        }
        ref += r1 - r0;
      }
    }
  }

  if (join_sums) {
    // Rank by rank; a sum's partial (scratch block in_blocks + j of its
    // owner o) moves past o's partials of lower ranks.
    Plan& out = plans->sums;
    Reset(p, false, sum_transfers, sum_refs, &out);
    thread_local std::vector<int32_t> thread_placed;  // per owner: partials of the ranks so far
    thread_placed.assign(n, 0);
    int32_t* const placed = thread_placed.data();
    uint32_t transfer = 0, ref = 0;
    for (int r = 0; r < n; ++r) {
      const MoeCombineShare& s = *shares[r];
      std::copy(s.sums.refs.begin(), s.sums.refs.end(), out.refs.begin() + ref);
      std::copy(s.sums.weights.begin(), s.sums.weights.end(), out.weights.begin() + ref);
      for (const Transfer& in : s.sums.transfers) {
        Transfer t = in;
        t.src_begin += ref;
        t.dst_begin += ref;
        for (uint32_t k = t.src_begin; k < t.src_begin + t.src_count; ++k) {
          BlockRef& b = out.refs[k];
          if (b.block >= in_blocks) b.block += placed[b.rank];
        }
        out.transfers[transfer++] = t;
      }
      ref += static_cast<uint32_t>(s.sums.refs.size());
      for (int o = 0; o < n; ++o) placed[o] += static_cast<int32_t>(s.first_partial[o + 1] - s.first_partial[o]);
    }
  }
  return Status::Ok();
}

Status BuildMoeCombinePlans(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                            const std::vector<const void*>& weights, bool stage_all, MoeCombinePlans* plans) {
  const int n = p.group_size;
  if (static_cast<int>(pair_slot.size()) != n || (!weights.empty() && static_cast<int>(weights.size()) != n))
    return Status::Error(std::string(kName) + ": " + std::to_string(pair_slot.size()) +
                         " ranks' slots for a group of " + std::to_string(n));
  std::vector<MoeCombineShare> shares(n);
  std::vector<const MoeCombineShare*> views(n);
  for (int r = 0; r < n; ++r) {
    const Status st = BuildMoeCombineShare(p, stage_all, r, pair_slot[r], weights.empty() ? nullptr : weights[r], &shares[r]);
    if (!st.ok) return st;
    views[r] = &shares[r];
  }
  return JoinMoeCombineShares(p, views, plans);
}

}  // namespace strata
