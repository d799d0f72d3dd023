// The ops that run as transfer plans, each defined once: its name, the
// blocks its buffers hold, its plan builder and its bus factor. The bindings,
// the model's bindings, the Python layer (through _core) and the C++ tests
// read them from here. Most ops' plans follow from their parameters alone
// (a fixed builder); ragged_all_to_all's is built at the rendezvous from the
// sizes its ranks publish (algorithms/ragged_all_to_all.h BuildRaggedPlan),
// so its entry has no builder function and its blocks are its rows.
#pragma once
#include <cstdint>
#include <vector>

#include "../runtime/collective.h"

namespace strata {

// Codes in registry order; Python passes them (from _core.op_names()).
enum class OpKind : int32_t {
  kAllReduce = 0, kAllGather, kReduceScatter, kAllToAll, kBroadcast, kPermute,
  kRaggedAllToAll,  // planned at the rendezvous: every op after kPermute is
  kMoeDispatch,
};
inline constexpr int32_t kOpKindCount = static_cast<int32_t>(OpKind::kMoeDispatch) + 1;
// The ops with a fixed builder come first: codes [0, kFixedPlanOpCount). Each
// has one generic FFI handler (bindings/handlers.cc); the others their own.
inline constexpr int32_t kFixedPlanOpCount = static_cast<int32_t>(OpKind::kPermute) + 1;

// How many blocks one rank's input or output holds over a group of n ranks.
enum class Blocks : int32_t {
  kOne,      // the whole buffer is one block
  kPerRank,  // one block per rank of the group (a rank's share or a peer's data)
  kPerRow,   // one block per row of the buffer: how many is known only at run time
};

struct CollectiveDef {
  OpKind kind;
  const char* name;     // "all_reduce": Python's and the model's name of the op
  // What the runtime runs: code == kind, "strata.<name>", the transfers
  // (add_transfers is nullptr when the plan is built at the rendezvous).
  PlanBuilder builder;
  Blocks in_blocks, out_blocks;
  // nccl-tests' busbw / algbw over a group of n ranks (doc/PERFORMANCE.md).
  double (*bus_factor)(int n);

  bool PlannedAtRendezvous() const { return builder.add_transfers == nullptr; }
  // Only for fixed-plan ops (kPerRow counts are not a function of n).
  int64_t InBlocks(int n) const { return in_blocks == Blocks::kPerRank ? n : 1; }
  int64_t OutBlocks(int n) const { return out_blocks == Blocks::kPerRank ? n : 1; }
};

// Every op, in OpKind order (fixed-plan ops first).
const std::vector<CollectiveDef>& Collectives();
const CollectiveDef& Collective(OpKind kind);
// The op with this code or name, or nullptr.
const CollectiveDef* FindCollective(int code);
const CollectiveDef* FindCollective(const char* name);

// An op's parameters from the plain values bindings and tools pass (enums as
// ints): its builder and block counts from `def` (a fixed-plan op), the rest
// as given.
OpParams MakeOpParams(const CollectiveDef& def, int dtype, int reduce_op, int root,
                      std::vector<int32_t> perm, int group_size, int64_t block_bytes, int64_t rows,
                      int mode, int cores, int engines, int planner, int64_t comm_buffer_bytes);

}  // namespace strata
