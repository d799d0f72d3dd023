#include "moe_plan.h"

#include <algorithm>
#include <numeric>
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

void MoeDispatchPlanBuilder::Reset(const MoeOpShape& p) {
  p_ = p;
  per_rank_ = p.local_experts() * p.capacity;
  slots_ = p.group_size * per_rank_;
  // Each owner's plan has the group plan's shape (strata mode runs them as
  // they are, a view of every rank's buffers each); a pooled builder's
  // plans keep their lists' storage.
  owners_.resize(p.group_size);
  for (Plan& owner : owners_) {
    owner.Clear();
    Header(&owner);
  }
  leads_.assign(p.group_size, 0);
  kept_.assign(p.group_size, 0);
  filled_.assign(p.group_size, 0);
  bad_.assign(p.group_size, 0);
  if (slots_ > INT32_MAX || p.group_size * p.tokens > INT32_MAX) {  // Finish says so
    src_.clear();
    return;
  }
  src_.assign(slots_, -1);
  lead_.resize(slots_);  // written for every filled slot before it is read
  next_.assign(slots_, -1);
}

int64_t MoeDispatchPlanBuilder::CapacityBytes() const {
  int64_t bytes = static_cast<int64_t>((src_.capacity() + lead_.capacity() + next_.capacity()) * sizeof(int32_t));
  for (const Plan& owner : owners_)
    bytes += static_cast<int64_t>(owner.transfers.capacity() * sizeof(Transfer) + owner.refs.capacity() * sizeof(BlockRef));
  return bytes;
}

void MoeDispatchPlanBuilder::Sources(int r, const int32_t* pair_slot) {
  if (src_.empty()) return;
  const int32_t first_token = static_cast<int32_t>(r * p_.tokens);
  const int64_t k_top = p_.topk, pairs = p_.tokens * k_top;
  const OwnerOf owner_of(std::max<int64_t>(per_rank_, 1));
  // Per owner, the slot leading the current token there (-1: none yet),
  // reset after each token: a lookup, not a search of the token's leads
  // so far, whose branches the routing decides (mispredicted at most pairs).
  thread_local std::vector<int32_t> thread_lead_of;
  if (thread_lead_of.size() < static_cast<size_t>(p_.group_size)) thread_lead_of.assign(p_.group_size, -1);
  int32_t* const lead_of = thread_lead_of.data();
  auto forget = [&](int64_t first, int64_t end) {  // pairs [first, end)'s entries, whose slots are good
    for (int64_t i = first; i < end; ++i)
      if (pair_slot[i] != -1) lead_of[owner_of(pair_slot[i])] = -1;
  };
  int64_t carried = 0, kept = 0;  // the rank's leads (rows it sends) and kept pairs
  for (int64_t token = 0, first = 0; first < pairs; ++token, first += k_top) {
    for (int64_t i = first; i < first + k_top; ++i) {
      const int32_t slot = pair_slot[i];
      if (slot == -1) continue;
      if (slot < -1 || slot >= slots_) {
        bad_[r] = 1;
        forget(first, i);  // the table as found
        return;
      }
      // Plain stores: ranks fill disjoint slots unless the slots are bad. A
      // slot two pairs fill leaves fewer filled slots than kept pairs, which
      // CheckSlots sees (an atomic claim per pair was four fifths of this).
      src_[slot] = first_token + static_cast<int32_t>(token);
      ++kept;
      const int32_t owner = owner_of(slot);
      const int32_t led_by = lead_of[owner];
      lead_[slot] = led_by;
      lead_of[owner] = led_by < 0 ? slot : led_by;
      carried += led_by < 0;
    }
    forget(first, first + k_top);
  }
  leads_[r] = carried;
  kept_[r] = kept;
}

void MoeDispatchPlanBuilder::Header(Plan* plan) const {
  plan->num_ranks = p_.group_size;
  plan->in_blocks = p_.tokens;
  plan->out_blocks = per_rank_;
  plan->block_bytes = p_.row_bytes();
  plan->dtype = p_.dtype;
  plan->op = ReduceOp::kNone;
}

bool MoeDispatchPlanBuilder::Owner(int32_t owner) {
  Plan& plan = owners_[owner];
  plan.transfers.clear();
  plan.refs.clear();
  if (src_.empty() || std::any_of(bad_.begin(), bad_.end(), [](uint8_t b) { return b != 0; })) return false;
  const int64_t base = owner * per_rank_;
  // Followers in ascending slots: pushed to the front of their lead's list
  // from the highest slot down (a token's lead and followers share an owner).
  // A follower whose lead is not a lead of the same token here comes from a
  // slot two pairs filled: nothing is built (no list can then run in a
  // circle), and CheckSlots names the pair.
  int64_t filled = 0;
  for (int64_t slot = base + per_rank_ - 1; slot >= base; --slot) {
    const int32_t from = src_[slot];
    if (from < 0) continue;
    ++filled;
    const int32_t l = lead_[slot];
    if (l < 0) continue;
    if (l < base || l >= base + per_rank_ || src_[l] != from || lead_[l] >= 0) {
      filled_[owner] = -1;
      return false;
    }
    next_[slot] = next_[l];
    next_[l] = static_cast<int32_t>(slot);
  }
  filled_[owner] = filled;
  plan.transfers.reserve(per_rank_);
  plan.refs.reserve(2 * per_rank_);
  // The last transfer can take the next row: it stays on one rank's rows.
  bool open_zeros = false, open_run = false;
  const OwnerOf rank_of(std::max<int64_t>(p_.tokens, 1));  // a group token's rank
  auto add_ref = [&plan](int32_t rank, int32_t block) {
    BlockRef& ref = plan.refs.emplace_back();
    ref.rank = rank;
    ref.block = block;
  };
  for (int32_t row = 0; row < per_rank_; ++row) {
    const int64_t slot = base + row;
    const int32_t token = src_[slot];
    if (token < 0) {
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
    const int32_t from_rank = rank_of(token);
    const BlockRef from{from_rank, static_cast<int32_t>(token - from_rank * p_.tokens)};
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
    // The transfer and its refs written in place, field by field: built on
    // the stack (or through Plan::Add's arrays) each was stored in halves and
    // read back whole to be copied, a store-forwarding stall per record (a
    // third of this loop).
    const uint32_t first_ref = static_cast<uint32_t>(plan.refs.size());
    add_ref(from.rank, from.block);
    add_ref(owner, row);
    for (int32_t f = next_[slot]; f >= 0; f = next_[f]) add_ref(owner, static_cast<int32_t>(f - base));
    Transfer& t = plan.transfers.emplace_back();
    t.src_begin = first_ref;
    t.src_count = 1;
    t.dst_begin = first_ref + 1;
    t.dst_count = static_cast<uint32_t>(plan.refs.size()) - t.dst_begin;
    t.local_copies = t.dst_count - 1;  // every destination is on this owner
    open_run = t.dst_count == 1;
  }
  return true;
}

int64_t MoeDispatchPlanBuilder::BusiestRankBytes() const {
  // Every rank writes each of its rows once (a copy or zeros) and reads, as
  // a source, one row per lead (a span of leads reads as many rows).
  const int64_t most = leads_.empty() ? 0 : *std::max_element(leads_.begin(), leads_.end());
  return (per_rank_ + most) * p_.row_bytes();
}

Status MoeDispatchPlanBuilder::CheckSlots(const std::vector<const int32_t*>& pair_slot) const {
  const int n = p_.group_size;
  if (static_cast<int64_t>(pair_slot.size()) != n)
    return Status::Error(std::string(kName) + ": " + std::to_string(pair_slot.size()) +
                         " ranks' slots for a group of " + std::to_string(n));
  if (src_.empty())
    return Status::Error(std::string(kName) + ": more than 2^31 slots or tokens per group is not supported");
  const int64_t kept = std::accumulate(kept_.begin(), kept_.end(), int64_t{0});
  const int64_t filled = std::accumulate(filled_.begin(), filled_.end(), int64_t{0});
  const bool conflict = std::any_of(filled_.begin(), filled_.end(), [](int64_t f) { return f < 0; });
  if (std::any_of(bad_.begin(), bad_.end(), [](uint8_t b) { return b != 0; }) || conflict || filled != kept) {
    // The first bad pair in (rank, token, k) order, as one walk finds it.
    const int64_t k_top = p_.topk, pairs = p_.tokens * k_top;
    std::vector<uint8_t> seen(slots_, 0);
    for (int r = 0; r < n; ++r)
      for (int64_t i = 0; i < pairs; ++i) {
        const int32_t slot = pair_slot[r][i];
        if (slot == -1) continue;
        const bool outside = slot < -1 || slot >= slots_;
        if (!outside && !seen[slot]) {
          seen[slot] = 1;
          continue;
        }
        std::ostringstream os;
        os << kName << ": rank " << r << "'s pair (token " << i / k_top << ", k=" << i % k_top << ") has slot "
           << slot << (outside ? ", outside [-1, " + std::to_string(slots_) + ")" : ", which another pair fills too");
        return Status::Error(os.str());
      }
    return Status::Error(std::string(kName) + ": bad pair slots");  // not reached: Sources saw one
  }
  return Status::Ok();
}

Status MoeDispatchPlanBuilder::Finish(const std::vector<const int32_t*>& pair_slot, Plan* plan) {
  Status st = CheckSlots(pair_slot);
  if (!st.ok) return st;
  Header(plan);
  size_t transfers = 0, refs = 0;
  for (const Plan& o : owners_) transfers += o.transfers.size(), refs += o.refs.size();
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
