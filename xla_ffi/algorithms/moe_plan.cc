#include "moe_plan.h"

#include <algorithm>
#include <sstream>
#include <string>

#include "op_registry.h"

namespace strata {

namespace {
const char* const kName = Collective(OpKind::kMoeDispatch).builder.name;  // "strata.moe.dispatch"

}  // namespace

OpParams MoeDispatchRunParams(const MoeOpShape& p) {
  OpParams o;
  o.builder = &Collective(OpKind::kMoeDispatch).builder;
  o.dtype = p.dtype;
  o.group_size = p.group_size;
  o.in_blocks = p.tokens;
  o.out_blocks = p.local_experts() * p.capacity;
  o.block_bytes = p.row_bytes();
  o.rows = 1;
  o.mode = p.mode;
  o.cores = p.cores;
  o.engines = p.engines;
  o.planner = p.planner;
  o.comm_buffer_bytes = p.comm_buffer_bytes;
  return o;
}

MoeDispatchPlanBuilder::MoeDispatchPlanBuilder(const MoeOpShape& p)
    : p_(p),
      per_rank_(p.local_experts() * p.capacity),
      slots_(p.group_size * per_rank_),
      owners_(p.group_size),
      owner_rank_bytes_(p.group_size),
      bad_(p.group_size, 0) {
  if (slots_ > INT32_MAX || p.group_size * p.tokens > INT32_MAX) return;  // Finish says so
  src_rank_.assign(slots_, -1);
  src_token_.resize(slots_);
  lead_.assign(slots_, -1);
  next_.assign(slots_, -1);
}

void MoeDispatchPlanBuilder::Sources(int r, const int32_t* pair_slot) {
  if (src_rank_.empty()) return;
  const int64_t k_top = p_.topk, pairs = p_.tokens * k_top;
  const OwnerOf owner_of(std::max<int64_t>(per_rank_, 1));
  struct Lead {
    int32_t owner;
    int32_t slot;
  };
  thread_local std::vector<Lead> thread_leads;  // the thread's scratch
  if (thread_leads.size() < static_cast<size_t>(k_top)) thread_leads.resize(k_top);
  Lead* const leads = thread_leads.data();
  for (int64_t token = 0, first = 0; first < pairs; ++token, first += k_top) {
    int64_t num_leads = 0;
    for (int64_t i = first; i < first + k_top; ++i) {
      const int32_t slot = pair_slot[i];
      if (slot == -1) continue;
      // A slot is claimed atomically: ranks fill disjoint slots unless the
      // slots are bad, and then Finish reports them as the serial walk would.
      if (slot < -1 || slot >= slots_ || __atomic_exchange_n(&src_rank_[slot], r, __ATOMIC_RELAXED) >= 0) {
        bad_[r] = 1;
        return;
      }
      src_token_[slot] = static_cast<int32_t>(token);
      const int32_t owner = owner_of(slot);
      int32_t led_by = -1;
      for (int64_t j = 0; j < num_leads && led_by < 0; ++j)
        if (leads[j].owner == owner) led_by = leads[j].slot;
      if (led_by < 0) leads[num_leads++] = {owner, slot};
      lead_[slot] = led_by;
    }
  }
}

void MoeDispatchPlanBuilder::Owner(int32_t owner) {
  if (src_rank_.empty() || std::any_of(bad_.begin(), bad_.end(), [](uint8_t b) { return b != 0; })) return;
  const int64_t base = owner * per_rank_;
  // Followers in ascending slots: pushed to the front of their lead's list
  // from the highest slot down (a token's lead and followers share an owner).
  for (int64_t slot = base + per_rank_ - 1; slot >= base; --slot) {
    const int32_t l = lead_[slot];
    if (src_rank_[slot] < 0 || l < 0) continue;
    next_[slot] = next_[l];
    next_[l] = static_cast<int32_t>(slot);
  }
  Plan& plan = owners_[owner];
  plan.block_bytes = p_.row_bytes();  // for its Columns
  plan.transfers.clear();
  plan.refs.clear();
  plan.transfers.reserve(per_rank_);
  plan.refs.reserve(2 * per_rank_);
  std::vector<BlockRef> dsts;
  // The last transfer can take the next row: it stays on one rank's rows.
  bool open_zeros = false, open_run = false;
  for (int32_t row = 0; row < per_rank_; ++row) {
    const int64_t slot = base + row;
    const int32_t from_rank = src_rank_[slot];
    if (from_rank < 0) {
      if (open_zeros) {
        plan.transfers.back().span++;
        continue;
      }
      const BlockRef dst{owner, row};
      plan.Add(nullptr, 0, &dst, 1);
      open_zeros = true;
      open_run = false;
      continue;
    }
    open_zeros = false;
    if (lead_[slot] >= 0) {
      open_run = false;  // a follower: its lead's transfer writes it
      continue;
    }
    const BlockRef from{from_rank, src_token_[slot]};
    if (next_[slot] < 0 && open_run) {
      const Transfer& t = plan.transfers.back();
      const BlockRef& s = plan.refs[t.src_begin];
      const BlockRef& d = plan.refs[t.dst_begin];
      if (s.rank == from.rank && s.block + static_cast<int64_t>(t.span) == from.block &&
          d.block + static_cast<int64_t>(t.span) == row) {
        plan.transfers.back().span++;
        continue;
      }
    }
    dsts.clear();
    dsts.push_back({owner, row});
    for (int32_t f = next_[slot]; f >= 0; f = next_[f]) dsts.push_back({owner, static_cast<int32_t>(f - base)});
    plan.Add(&from, 1, dsts.data(), static_cast<uint32_t>(dsts.size()));
    open_run = dsts.size() == 1;
  }
  owner_rank_bytes_[owner].assign(p_.group_size, 0);
  AddRankBytes(plan, &owner_rank_bytes_[owner]);
}

Status MoeDispatchPlanBuilder::Finish(const std::vector<const int32_t*>& pair_slot, Plan* plan) {
  const int n = p_.group_size;
  if (static_cast<int64_t>(pair_slot.size()) != n)
    return Status::Error(std::string(kName) + ": " + std::to_string(pair_slot.size()) +
                         " ranks' slots for a group of " + std::to_string(n));
  if (src_rank_.empty())
    return Status::Error(std::string(kName) + ": more than 2^31 slots or tokens per group is not supported");
  if (std::any_of(bad_.begin(), bad_.end(), [](uint8_t b) { return b != 0; })) {
    // The first bad pair in (rank, token, k) order, as one walk finds it.
    const int64_t k_top = p_.topk, pairs = p_.tokens * k_top;
    std::vector<uint8_t> filled(slots_, 0);
    for (int r = 0; r < n; ++r)
      for (int64_t i = 0; i < pairs; ++i) {
        const int32_t slot = pair_slot[r][i];
        if (slot == -1) continue;
        const bool outside = slot < -1 || slot >= slots_;
        if (!outside && !filled[slot]) {
          filled[slot] = 1;
          continue;
        }
        std::ostringstream os;
        os << kName << ": rank " << r << "'s pair (token " << i / k_top << ", k=" << i % k_top << ") has slot "
           << slot << (outside ? ", outside [-1, " + std::to_string(slots_) + ")" : ", which another pair fills too");
        return Status::Error(os.str());
      }
    return Status::Error(std::string(kName) + ": bad pair slots");  // not reached: Sources saw one
  }
  plan->num_ranks = n;
  plan->in_blocks = p_.tokens;
  plan->out_blocks = per_rank_;
  plan->block_bytes = p_.row_bytes();
  plan->dtype = p_.dtype;
  plan->op = ReduceOp::kNone;
  size_t transfers = 0, refs = 0;
  for (const Plan& o : owners_) transfers += o.transfers.size(), refs += o.refs.size();
  std::vector<int64_t> rank_bytes(n, 0);
  for (const std::vector<int64_t>& bytes : owner_rank_bytes_)
    for (size_t r = 0; r < bytes.size(); ++r) rank_bytes[r] += bytes[r];
  busiest_ = rank_bytes.empty() ? 0 : *std::max_element(rank_bytes.begin(), rank_bytes.end());
  plan->transfers.clear();
  plan->refs.clear();
  plan->transfers.reserve(transfers);
  plan->refs.reserve(refs);
  for (const Plan& o : owners_) {
    const uint32_t offset = static_cast<uint32_t>(plan->refs.size());
    plan->refs.insert(plan->refs.end(), o.refs.begin(), o.refs.end());
    for (Transfer t : o.transfers) {
      t.src_begin += offset;
      t.dst_begin += offset;
      plan->transfers.push_back(t);
    }
  }
  return Status::Ok();
}

Status BuildMoeDispatchPlan(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot, Plan* plan) {
  if (static_cast<int64_t>(pair_slot.size()) != p.group_size)
    return Status::Error(std::string(kName) + ": " + std::to_string(pair_slot.size()) +
                         " ranks' slots for a group of " + std::to_string(p.group_size));
  MoeDispatchPlanBuilder builder(p);
  for (int r = 0; r < p.group_size; ++r) builder.Sources(r, pair_slot[r]);
  for (int o = 0; o < p.group_size; ++o) builder.Owner(o);
  return builder.Finish(pair_slot, plan);
}

}  // namespace strata
