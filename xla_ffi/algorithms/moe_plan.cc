#include "moe_plan.h"

#include <algorithm>
#include <sstream>
#include <string>

#include "op_registry.h"

namespace strata {

namespace {
const char* const kName = Collective(OpKind::kMoeDispatch).builder.name;  // "strata.moe.dispatch"

// slot / per_rank for 0 <= slot < 2^31 without a divide: q = (slot * m) >>
// (31 + L), m = ceil(2^(31+L) / d), L = ceil(log2 d), exact for such slots
// (m * d - 2^(31+L) < d <= 2^L: Granlund and Montgomery's round-up method).
class OwnerOf {
 public:
  explicit OwnerOf(int64_t d) : shift_(31 + CeilLog2(d)), magic_(((uint64_t{1} << shift_) + d - 1) / d) {}
  int32_t operator()(int32_t slot) const { return static_cast<int32_t>((static_cast<uint64_t>(slot) * magic_) >> shift_); }

 private:
  static int CeilLog2(int64_t d) {
    int l = 0;
    while ((int64_t{1} << l) < d) ++l;
    return l;
  }
  int shift_;
  uint64_t magic_;
};

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

  // Per global slot: the rank and token filling it (rank -1: empty); -1 if
  // it leads its token on its rank, else the lead's slot; the next of a
  // lead's followers (a lead's entry: its first), ascending. No division per
  // slot or pair (a 64-bit divide each was most of the build): owners come
  // from a reciprocal, rows from nested loops.
  std::vector<int32_t> src_rank(slots, -1), src_token(slots), lead(slots, -1), next(slots, -1);
  const OwnerOf owner_of(std::max<int64_t>(per_rank, 1));
  struct Lead {
    int32_t owner;
    int32_t slot;
  };
  std::vector<Lead> leads(k_top);
  for (int r = 0; r < n; ++r) {
    const int32_t* mine = pair_slot[r];
    for (int64_t token = 0, first = 0; first < pairs; ++token, first += k_top) {
      int64_t num_leads = 0;
      for (int64_t i = first; i < first + k_top; ++i) {
        const int32_t slot = mine[i];
        if (slot == -1) continue;
        if (slot < -1 || slot >= slots || src_rank[slot] >= 0) {
          std::ostringstream os;
          os << kName << ": rank " << r << "'s pair (token " << token << ", k=" << i - first << ") has slot "
             << slot << (slot < -1 || slot >= slots ? ", outside [-1, " + std::to_string(slots) + ")"
                                                     : ", which another pair fills too");
          return Status::Error(os.str());
        }
        src_rank[slot] = r;
        src_token[slot] = static_cast<int32_t>(token);
        const int32_t owner = owner_of(slot);
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
    if (src_rank[slot] < 0 || l < 0) continue;
    next[slot] = next[l];
    next[l] = static_cast<int32_t>(slot);
  }

  // At most a transfer per slot, a source and a destination per pair.
  plan->transfers.reserve(std::min<int64_t>(slots, n * pairs + n));
  plan->refs.reserve(2 * std::min<int64_t>(slots, n * pairs) + n);
  std::vector<BlockRef> dsts;
  for (int32_t owner = 0; owner < n; ++owner) {
    // The last transfer can take the next row: it stays on one rank's rows.
    bool open_zeros = false, open_run = false;
    const int64_t base = owner * per_rank;
    for (int32_t row = 0; row < per_rank; ++row) {
      const int64_t slot = base + row;
      const int32_t from_rank = src_rank[slot];
      if (from_rank < 0) {
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
      const BlockRef from{from_rank, src_token[slot]};
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
      for (int32_t f = next[slot]; f >= 0; f = next[f]) dsts.push_back({owner, static_cast<int32_t>(f - base)});
      plan->Add(&from, 1, dsts.data(), static_cast<uint32_t>(dsts.size()));
      open_run = dsts.size() == 1;
    }
  }
  return Status::Ok();
}

}  // namespace strata
