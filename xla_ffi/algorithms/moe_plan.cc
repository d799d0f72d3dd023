#include "moe_plan.h"

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
  o.comm_buffer_bytes = p.comm_buffer_bytes;
  return o;
}

Status BuildMoeDispatchPlan(const MoeOpShape& p, const std::vector<const int32_t*>& pair_slot, Plan* plan) {
  const int n = p.group_size;
  const int64_t k_top = p.topk, tokens = p.tokens, pairs = tokens * k_top;
  const int64_t per_rank = p.local_experts() * p.capacity, slots = n * per_rank;
  if (static_cast<int64_t>(pair_slot.size()) != n)
    return Status::Error(std::string(kName) + ": " + std::to_string(pair_slot.size()) +
                         " ranks' slots for a group of " + std::to_string(n));
  if (slots > INT32_MAX || n * tokens > INT32_MAX)
    return Status::Error(std::string(kName) + ": more than 2^31 slots or tokens per group is not supported");
  plan->num_ranks = n;
  plan->in_blocks = tokens;
  plan->out_blocks = per_rank;
  plan->block_bytes = p.row_bytes();
  plan->dtype = p.dtype;
  plan->op = ReduceOp::kNone;

  // Per global slot: the token filling it (rank * tokens + t, -1: empty);
  // -1 if it leads its token on its rank, else the lead's slot; the next of
  // a lead's followers (a lead's entry: its first), ascending.
  std::vector<int32_t> source(slots, -1), lead(slots, -1), next(slots, -1);
  struct Lead {
    int64_t owner;
    int32_t slot;
  };
  std::vector<Lead> leads(k_top);
  for (int r = 0; r < n; ++r) {
    const int32_t* mine = pair_slot[r];
    for (int64_t first = 0; first < pairs; first += k_top) {
      int64_t num_leads = 0;
      for (int64_t i = first; i < first + k_top; ++i) {
        const int32_t slot = mine[i];
        if (slot == -1) continue;
        if (slot < -1 || slot >= slots || source[slot] >= 0) {
          std::ostringstream os;
          os << kName << ": rank " << r << "'s pair (token " << i / k_top << ", k=" << i % k_top << ") has slot "
             << slot << (slot < -1 || slot >= slots ? ", outside [-1, " + std::to_string(slots) + ")"
                                                     : ", which another pair fills too");
          return Status::Error(os.str());
        }
        source[slot] = static_cast<int32_t>(r * tokens + i / k_top);
        const int64_t owner = slot / per_rank;
        int32_t led_by = -1;
        for (int64_t j = 0; j < num_leads && led_by < 0; ++j)
          if (leads[j].owner == owner) led_by = leads[j].slot;
        if (led_by < 0) leads[num_leads++] = {owner, slot};
        lead[slot] = led_by;
      }
    }
  }
  // Followers in ascending slots: pushed to the front of their lead's list
  // from the highest slot down.
  for (int64_t slot = slots - 1; slot >= 0; --slot) {
    const int32_t l = lead[slot];
    if (source[slot] < 0 || l < 0) continue;
    next[slot] = next[l];
    next[l] = static_cast<int32_t>(slot);
  }

  std::vector<BlockRef> dsts;
  bool open_zeros = false, open_run = false;  // the last transfer can take the next row
  for (int64_t slot = 0; slot < slots; ++slot) {
    const int32_t owner = static_cast<int32_t>(slot / per_rank), row = static_cast<int32_t>(slot % per_rank);
    if (row == 0) open_zeros = open_run = false;  // a transfer stays on one rank's rows
    const int32_t src = source[slot];
    if (src < 0) {
      if (open_zeros) {
        plan->transfers.back().span++;
        continue;
      }
      const BlockRef dst{owner, row};
      plan->Add(nullptr, 0, &dst, 1);
      open_zeros = true;
      open_run = false;
      continue;
    }
    open_zeros = false;
    if (lead[slot] >= 0) {
      open_run = false;  // a follower: its lead's transfer writes it
      continue;
    }
    const BlockRef from{static_cast<int32_t>(src / tokens), static_cast<int32_t>(src % tokens)};
    if (next[slot] < 0 && open_run) {
      const Transfer& t = plan->transfers.back();
      const BlockRef& s = plan->refs[t.src_begin];
      const BlockRef& d = plan->refs[t.dst_begin];
      if (s.rank == from.rank && s.block + static_cast<int64_t>(t.span) == from.block &&
          d.block + static_cast<int64_t>(t.span) == row) {
        plan->transfers.back().span++;
        continue;
      }
    }
    dsts.clear();
    dsts.push_back({owner, row});
    for (int32_t f = next[slot]; f >= 0; f = next[f]) dsts.push_back({owner, static_cast<int32_t>(f % per_rank)});
    plan->Add(&from, 1, dsts.data(), static_cast<uint32_t>(dsts.size()));
    open_run = dsts.size() == 1;
  }
  return Status::Ok();
}

}  // namespace strata
