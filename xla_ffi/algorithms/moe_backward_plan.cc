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
  plan->ClearKeepingElements();
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

// Entries (source << 32 | row) in row order, sorted by source: an LSD radix
// sort, a byte of the source a pass over the bytes max_source needs (a
// std::sort of them was a third of the build). Stable, so equal sources (a
// corrupt handle, refused later) keep row order, as sorting whole entries would.
void SortBySource(uint32_t max_source, std::vector<uint64_t>* entries, std::vector<uint64_t>* scratch) {
  scratch->resize(entries->size());
  for (int shift = 32; shift < 64 && (static_cast<uint64_t>(max_source) >> (shift - 32)) != 0; shift += 8) {
    size_t at[257] = {};
    for (const uint64_t e : *entries) at[((e >> shift) & 255) + 1]++;
    for (int i = 0; i < 256; ++i) at[i + 1] += at[i];
    uint64_t* out = scratch->data();
    for (const uint64_t e : *entries) out[at[(e >> shift) & 255]++] = e;
    entries->swap(*scratch);
  }
}
}  // namespace

int64_t MoeBackwardShare::CapacityBytes() const {
  int64_t bytes = 0;
  for (const Plan* plan : {&carry, &scale, &dots})
    bytes += plan->refs.capacity() * sizeof(BlockRef) + plan->transfers.capacity() * sizeof(Transfer) +
             plan->weights.capacity() * sizeof(double) + plan->pieces.capacity() * sizeof(Piece) +
             plan->tasks.capacity() * sizeof(LaneTask) + plan->moves.capacity() * sizeof(Move);
  for (const LaneCredit* credit : {&carry_credit, &scale_credit, &dots_credit})
    bytes += credit->tasks.capacity() * sizeof(LaneTask);
  return bytes + weight_source.capacity() * sizeof(int32_t) + carry_rank_bytes.capacity() * sizeof(int64_t) +
         row_transfer.capacity() * sizeof(uint32_t) +
         (by_source.capacity() + sort_scratch.capacity()) * sizeof(uint64_t);
}

Status BuildMoeBackwardShare(const MoeOpShape& p, int o, const int32_t* pair_slot, const int32_t* slot_source,
                             MoeBackwardShare* share) {
  const int n = p.group_size;
  const int64_t k_top = p.topk, pairs = p.tokens * p.topk;
  const int64_t per_rank = p.local_experts() * p.capacity, slots = n * per_rank;
  ResetAll(p, &share->carry, &share->scale, &share->dots);
  share->weight_source.clear();
  share->carry_rank_bytes.assign(n, 0);
  if (slots > INT32_MAX || n * pairs > INT32_MAX)
    return Status::Error(std::string(kName) + ": more than 2^31 slots or pairs in a group is not supported");
  auto fail = [&](const std::string& why) { return Status::Error(std::string(kName) + ": " + why); };

  // The filled rows by source (r * pairs + t * topk + k): token by token,
  // ranks then tokens ascending, a token's rows here together, k ascending.
  std::vector<uint64_t>& by_source = share->by_source;
  by_source.clear();
  share->row_transfer.assign(per_rank, UINT32_MAX);
  for (int64_t row = 0; row < per_rank; ++row) {
    const int32_t src = slot_source[row];
    if (src == -1) continue;
    if (src < -1 || src >= n * pairs) {
      std::ostringstream os;
      os << "owner " << o << "'s slot_source[" << row << "] = " << src << " is outside [-1, " << n * pairs << ")";
      return fail(os.str());
    }
    by_source.push_back(static_cast<uint64_t>(src) << 32 | static_cast<uint64_t>(row));
  }
  SortBySource(static_cast<uint32_t>(n * pairs - 1), &by_source, &share->sort_scratch);

  // The runs of empty rows and of rank o's dropped pairs (checked in range),
  // counted first: every list below is sized once and written in place
  // (Plan::Add a transfer at a time, its push_backs' checks and the weights'
  // fill loop, was a quarter of the build).
  int64_t empty_runs = 0, dropped_runs = 0;
  for (int64_t row = 0; row < per_rank; ++row)
    empty_runs += slot_source[row] < 0 && (row == 0 || slot_source[row - 1] >= 0);
  for (int64_t i = 0; i < pairs; ++i) {
    if (pair_slot[i] < -1 || pair_slot[i] >= slots) {
      std::ostringstream os;
      os << "rank " << o << "'s pair_slot[" << i << "] = " << pair_slot[i] << " is outside [-1, " << slots << ")";
      return fail(os.str());
    }
    dropped_runs += pair_slot[i] == -1 && (i == 0 || pair_slot[i - 1] != -1);
  }
  // 32-bit divides (sources < 2^31): a 64-bit one per row was a third of the build.
  const uint32_t u_topk = static_cast<uint32_t>(k_top), u_pairs = static_cast<uint32_t>(pairs);
  const uint32_t u_tokens = static_cast<uint32_t>(p.tokens);
  size_t carried = 0;
  for (size_t i = 0; i < by_source.size(); ++i)
    carried += i == 0 || (by_source[i] >> 32) / u_topk != (by_source[i - 1] >> 32) / u_topk;
  const size_t filled = by_source.size();
  Plan& carry = share->carry;
  Plan& scale = share->scale;
  Plan& dots = share->dots;
  carry.transfers.resize(carried);
  carry.refs.resize(2 * carried);
  scale.transfers.resize(filled + empty_runs);
  scale.refs.resize(2 * filled + empty_runs);
  scale.weights.assign(scale.refs.size(), 1.0);
  share->weight_source.assign(scale.refs.size(), -1);
  dots.transfers.resize(filled + dropped_runs);
  dots.refs.resize(3 * filled + dropped_runs);
  // Transfer i of `plan`: refs from `at` on, `srcs` sources then `dsts`
  // destinations; returns where the next one's refs start.
  auto put = [](Plan& plan, size_t i, uint32_t at, uint32_t srcs, uint32_t dsts, uint32_t span) {
    Transfer& t = plan.transfers[i];
    t.src_begin = at;
    t.src_count = srcs;
    t.dst_begin = at + srcs;
    t.dst_count = dsts;
    t.span = span;
    t.local_copies = 0;  // one destination
    return at + srcs + dsts;
  };

  // In that order (the host runs a few tokens' pairs of each owner's share at
  // a time, MoeBackwardSharesPhase: one run of its transfers, read in order;
  // and a carried row's readers follow one another, so on the NPU it is read
  // from cache): per token, its carried row, then w x it into each of the
  // token's rows here and each pair's dot.
  uint32_t last_token = UINT32_MAX;
  int32_t j = -1;
  for (size_t i = 0; i < filled; ++i) {
    const uint64_t entry = by_source[i];
    const uint32_t src = static_cast<uint32_t>(entry >> 32);
    const int32_t dst_row = static_cast<int32_t>(static_cast<uint32_t>(entry));
    const uint32_t token = src / u_topk;  // r * tokens + t
    const uint32_t r = token / u_tokens;
    if (token != last_token) {
      ++j;
      put(carry, j, 2 * j, 1, 1, 1);
      carry.refs[2 * j] = {static_cast<int32_t>(r), static_cast<int32_t>(token - r * u_tokens)};
      carry.refs[2 * j + 1] = {o, j};
      last_token = token;
    }
    const int32_t pair = static_cast<int32_t>(src - r * u_pairs);
    share->row_transfer[dst_row] = static_cast<uint32_t>(i);
    // scale: the carried row (scratch starts at block 0: no input) into the row.
    put(scale, i, static_cast<uint32_t>(2 * i), 1, 1, 1);
    scale.refs[2 * i] = {o, j};
    scale.refs[2 * i + 1] = {o, dst_row};
    share->weight_source[2 * i] = static_cast<int32_t>(src);
    // dots: <carried row, expert row> into the pair's value on its rank.
    put(dots, i, static_cast<uint32_t>(3 * i), 2, 1, 1);
    dots.refs[3 * i] = {o, static_cast<int32_t>(per_rank + j)};
    dots.refs[3 * i + 1] = {o, dst_row};
    dots.refs[3 * i + 2] = {static_cast<int32_t>(r), pair};
  }
  share->pair_transfers = static_cast<uint32_t>(filled);
  // The runs of empty rows, zeroed.
  size_t next = filled;
  uint32_t at = static_cast<uint32_t>(2 * filled);
  for (int64_t row = 0; row < per_rank;) {
    if (slot_source[row] >= 0) {
      ++row;
      continue;
    }
    int64_t end = row + 1;
    while (end < per_rank && slot_source[end] < 0) ++end;
    scale.refs[at] = {o, static_cast<int32_t>(row)};
    at = put(scale, next++, at, 0, 1, static_cast<uint32_t>(end - row));
    row = end;
  }
  // Rank o's dropped pairs' values, zeroed on it, a run at a time.
  next = filled;
  at = static_cast<uint32_t>(3 * filled);
  for (int64_t i = 0; i < pairs;) {
    if (pair_slot[i] != -1) {
      ++i;
      continue;
    }
    int64_t end = i + 1;
    while (end < pairs && pair_slot[end] == -1) ++end;
    dots.refs[at] = {o, static_cast<int32_t>(i)};
    at = put(dots, next++, at, 0, 1, static_cast<uint32_t>(end - i));
    i = end;
  }
  AddRankBytes(share->carry, &share->carry_rank_bytes);
  return Status::Ok();
}

void FillMoeBackwardWeights(const MoeOpShape& p, const std::vector<const void*>& weights, MoeBackwardShare* share) {
  const int64_t pairs = p.tokens * p.topk;
  const bool wide = p.dtype == DType::F64;  // float64 weights
  std::vector<double>& w = share->scale.weights;
  for (size_t i = 0; i < share->weight_source.size(); ++i) {
    const int32_t src = share->weight_source[i];
    if (src < 0) continue;
    const int r = static_cast<int>(src / pairs);
    const int64_t pair = src - r * pairs;
    const void* mine = weights.empty() ? nullptr : weights[r];
    w[i] = !mine ? 1.0 : wide ? static_cast<const double*>(mine)[pair] : static_cast<const float*>(mine)[pair];
  }
}

bool MoeBackwardCarryOnSdma(const MoeOpShape& p, const std::vector<const MoeBackwardShare*>& shares,
                            double descriptor_us, double sdma_gbps) {
  std::vector<int64_t> rank_bytes(p.group_size, 0);
  for (const MoeBackwardShare* share : shares)
    for (int r = 0; r < p.group_size; ++r) rank_bytes[r] += share->carry_rank_bytes[r];
  const int64_t busiest = rank_bytes.empty() ? 0 : *std::max_element(rank_bytes.begin(), rank_bytes.end());
  return MovesOnSdma(busiest, p.engines, descriptor_us, sdma_gbps);
}

Phase MoeBackwardSharesPhase(const MoeOpShape& p, std::vector<std::shared_ptr<const MoeBackwardShare>> shares,
                             std::vector<const int32_t*> pair_slot, const PlanBuffers& scale_buffers,
                             const PlanBuffers& dot_buffers) {
  const int n = p.group_size;
  auto at_zero = std::make_shared<const std::vector<uint32_t>>(n, 0);  // a share's carry starts at 0
  enum { kScales = 0, kDots };
  std::vector<PlanGroup> groups(2);
  groups[kScales].buffers = scale_buffers;
  groups[kDots].buffers = dot_buffers;
  for (const std::shared_ptr<const MoeBackwardShare>& share : shares) {
    const std::shared_ptr<const Plan> carry(share, &share->carry);
    groups[kScales].plans.push_back({std::shared_ptr<const Plan>(share, &share->scale), carry, at_zero});
    groups[kDots].plans.push_back({std::shared_ptr<const Plan>(share, &share->dots), carry, at_zero});
  }
  // A token's pairs read and write ~4 rows each; a task is ~4 host chunks of
  // them, so each owner's run of its transfers in a task is long enough for
  // its records to stream (one chunk a task was ~5 % slower).
  const int64_t tokens_per_task =
      std::max<int64_t>(1, 4 * kHostChunkBytes / std::max<int64_t>(1, 4 * p.row_bytes() * p.topk));
  const int64_t tasks_per_rank = (p.tokens + tokens_per_task - 1) / tokens_per_task;
  const uint64_t token_tasks = static_cast<uint64_t>(n * tasks_per_rank);
  auto order = [n, p, shares = std::move(shares), pair_slot = std::move(pair_slot), tokens_per_task, tasks_per_rank,
                token_tasks](uint64_t task, const TransferRunner& run) {
    if (task >= token_tasks) {  // an owner's zero runs
      const int o = static_cast<int>(task - token_tasks);
      const MoeBackwardShare& share = *shares[o];
      for (uint32_t i = share.pair_transfers; i < share.scale.transfers.size(); ++i) run.Run(kScales, o, i);
      for (uint32_t i = share.pair_transfers; i < share.dots.transfers.size(); ++i) run.Run(kDots, o, i);
      return;
    }
    const int r = static_cast<int>(task / tasks_per_rank);
    const int64_t first = static_cast<int64_t>(task % tasks_per_rank) * tokens_per_task;
    const int64_t end = std::min(p.tokens, first + tokens_per_task) * p.topk;
    const int64_t per_rank = p.local_experts() * p.capacity;
    const int32_t* slots = pair_slot[r];
    // The task's pairs on one owner are one run of its transfers (an owner's
    // are in its tokens' order): its first pair's, as many as it has here.
    // Run owner by owner, each run reads its plans' records in order, as the
    // hardware's prefetchers follow; pair by pair, jumping between the
    // owners, each record was a miss. The task's carried rows (a few tokens'
    // ct_y) stay in cache from one owner to the next.
    thread_local std::vector<int32_t> owners;
    thread_local std::vector<uint32_t> begin, count;
    if (count.size() < static_cast<size_t>(n)) {
      begin.assign(n, 0);
      count.assign(n, 0);
    }
    owners.clear();
    for (int64_t pair = first * p.topk; pair < end; ++pair) {
      const int32_t slot = slots[pair];
      if (slot < 0) continue;
      const int o = static_cast<int>(slot / per_rank);
      if (count[o]++ == 0) {
        owners.push_back(o);
        begin[o] = shares[o]->row_transfer[slot - o * per_rank];
      }
    }
    for (const int o : owners) {
      for (uint32_t i = begin[o], last = begin[o] + count[o]; i < last; ++i) {
        run.Run(kScales, o, i);
        run.Run(kDots, o, i);
      }
      count[o] = 0;
    }
  };
  return OrderedPlanPhase(std::move(groups), token_tasks + n, std::move(order));
}

namespace {
// The shares (weights filled) joined into the group's plans, owner by owner:
// each share's transfers, refs and weights copied after those of lower
// owners, its refs' indices moved by as much.
void JoinShares(const MoeOpShape& p, const std::vector<const MoeBackwardShare*>& shares, MoeBackwardPlans* plans) {
  const int n = p.group_size;
  ResetAll(p, &plans->carry, &plans->scale, &plans->dots);
  Plan* whole[3] = {&plans->carry, &plans->scale, &plans->dots};
  // Per plan (carry, scale, dots), where each owner's transfers and refs go.
  std::vector<uint32_t> transfer_at[3], ref_at[3];
  for (int i = 0; i < 3; ++i) transfer_at[i].assign(n + 1, 0), ref_at[i].assign(n + 1, 0);
  int64_t scratch_blocks = 0;
  for (int o = 0; o < n; ++o) {
    const MoeBackwardShare& share = *shares[o];
    const Plan* part[3] = {&share.carry, &share.scale, &share.dots};
    for (int i = 0; i < 3; ++i) {
      transfer_at[i][o + 1] = transfer_at[i][o] + static_cast<uint32_t>(part[i]->transfers.size());
      ref_at[i][o + 1] = ref_at[i][o] + static_cast<uint32_t>(part[i]->refs.size());
    }
    scratch_blocks = std::max<int64_t>(scratch_blocks, static_cast<int64_t>(share.carry.transfers.size()));
  }
  for (int i = 0; i < 3; ++i) {
    whole[i]->transfers.resize(transfer_at[i][n]);
    whole[i]->refs.resize(ref_at[i][n]);
  }
  plans->scale.weights.resize(ref_at[1][n]);
  plans->carry.out_blocks = scratch_blocks;
  plans->scale.scratch_blocks = scratch_blocks;
  plans->dots.scratch_blocks = scratch_blocks;
  plans->first_carry.assign(transfer_at[0].begin(), transfer_at[0].end() - 1);
  for (int o = 0; o < n; ++o) {
    const MoeBackwardShare& share = *shares[o];
    const Plan* part[3] = {&share.carry, &share.scale, &share.dots};
    for (int i = 0; i < 3; ++i) {
      const uint32_t refs = ref_at[i][o];
      Transfer* to = whole[i]->transfers.data() + transfer_at[i][o];
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
      std::memcpy(plans->scale.weights.data() + ref_at[1][o], share.scale.weights.data(),
                  share.scale.weights.size() * sizeof(double));
  }
}
}  // namespace

std::string MoeLayoutDisagreement(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                                  const std::vector<const int32_t*>& slot_source) {
  const int n = p.group_size;
  const int64_t pairs = p.tokens * p.topk, per_rank = p.local_experts() * p.capacity;
  const char* const kWhy = "; the handle was modified or mixes two dispatches";
  int64_t kept = 0, filled = 0;
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < pairs; ++i) {
      const int32_t slot = pair_slot[r][i];
      if (slot < 0) continue;
      kept++;
      const int32_t source = slot < n * per_rank ? slot_source[slot / per_rank][slot % per_rank] : -1;
      if (source == r * pairs + i) continue;
      std::ostringstream os;
      os << "DispatchHandle fields disagree: rank " << r << " pair_slot[" << i << "] = " << slot;
      if (slot >= n * per_rank) os << ", outside the group's " << n * per_rank << " slots";
      else os << " but that slot's slot_source is " << source;
      os << kWhy;
      return os.str();
    }
    for (int64_t j = 0; j < per_rank; ++j) filled += slot_source[r][j] >= 0;
  }
  if (kept == filled) return "";
  std::ostringstream os;
  os << "DispatchHandle fields disagree: " << kept << " pairs have a slot but " << filled << " slots have a source"
     << kWhy;
  return os.str();
}

Status BuildMoeBackwardPlans(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot,
                             const std::vector<const int32_t*>& slot_source,
                             const std::vector<const void*>& weights, MoeBackwardPlans* plans) {
  const int n = p.group_size;
  plans->shares.resize(n);
  std::vector<const MoeBackwardShare*> shares;
  for (int o = 0; o < n; ++o) {
    MoeBackwardShare& share = plans->shares[o];
    const Status st = BuildMoeBackwardShare(p, o, pair_slot[o], slot_source[o], &share);
    if (!st.ok) return st;
    shares.push_back(&share);
  }
  if (const std::string why = MoeLayoutDisagreement(p, pair_slot, slot_source); !why.empty())
    return Status::Error(std::string(kName) + ": " + why);
  for (MoeBackwardShare& share : plans->shares) FillMoeBackwardWeights(p, weights, &share);
  JoinShares(p, shares, plans);
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

void PartitionMoeBackwardPlans(const MoeOpShape& p, MoeBackwardPlans* plans, double descriptor_us,
                               double sdma_gbps) {
  Plan& carry = plans->carry;
  carry.on_sdma = PlanMovesOnSdma(carry, 1, p.engines, descriptor_us, sdma_gbps);
  Partition(carry, carry.on_sdma ? p.engines : p.cores, p.planner);
  Partition(plans->scale, p.cores, p.planner);
  Partition(plans->dots, p.cores, p.planner, /*align=*/plans->dots.block_bytes);
}

}  // namespace strata
